"""Test support: Kubernetes RBAC authorization, as the API server decides it, for the emulated API.

A request is described by the attributes the API server's RBAC authorizer
reads (``k8s.io/apiserver/pkg/endpoints/request/requestinfo.go``: verb, API
group, resource, subresource, namespace, name) and allowed when a rule of a
Role bound in the request's namespace, or of a ClusterRole bound cluster-wide
(or by a RoleBinding in that namespace), matches all of them
(``plugin/pkg/auth/authorizer/rbac/rbac.go`` ``RuleAllows``):

- verb from the HTTP method: GET of a name ``get``, of a collection ``list``,
  with ``watch=true`` ``watch``; POST ``create``; PUT ``update``; PATCH
  ``patch``; DELETE of a name ``delete``, of a collection ``deletecollection``;
- a server-side apply (PATCH, ``application/apply-patch+yaml``) that creates
  the object is authorized a second time as ``create`` with the object's name
  (``apiserver/pkg/endpoints/handlers/patch.go``: ``createAuthorizerAttributes``,
  verb ``create``, ``Name: name``);
- resource ``pods/log``, ``jobsets/status``: resource and subresource joined
  by ``/``, matched exactly (no ``pods/*`` in our rules);
- ``resourceNames`` matches only requests that carry a name (so never a
  ``list``, a ``watch`` or a POST ``create``).

Not modelled: aggregated ClusterRoles, ``*`` wildcards in rules, non-resource
URLs (discovery is allowed to all, as ``system:discovery`` grants), groups,
impersonation, and the escalation checks on writing RBAC objects.
"""

from __future__ import annotations

from typing import Any

#: The bearer token a test client sends for a user is the user's name (the emulator trusts it).
BEARER_PREFIX = "Bearer "


def service_account_user(namespace: str, name: str) -> str:
    """The user name a ServiceAccount's token authenticates as (``system:serviceaccount:NS:NAME``)."""
    return f"system:serviceaccount:{namespace}:{name}"


def _subject_user(subject: dict[str, Any]) -> str | None:
    if subject.get("kind") == "ServiceAccount":
        return service_account_user(subject["namespace"], subject["name"])
    if subject.get("kind") == "User":
        return subject["name"]
    return None


def verb_of(method: str, name: str | None, params: dict[str, str]) -> str:
    """The RBAC verb of an HTTP request (requestinfo.go)."""
    method = method.upper()
    if method == "GET" or method == "HEAD":
        if params.get("watch", "").lower() in ("true", "1"):
            return "watch"
        return "get" if name else "list"
    if method == "DELETE":
        return "delete" if name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


class Authorizer:
    """RBAC over a set of Role, ClusterRole, RoleBinding and ClusterRoleBinding objects (as rendered)."""

    def __init__(self, objects: list[dict[str, Any]]):
        self.objects = [
            o for o in objects if o.get("kind") in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")
        ]
        self.denied: list[str] = []

    def _role(self, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
        for obj in self.objects:
            meta = obj["metadata"]
            if (
                obj["kind"] == kind
                and meta["name"] == name
                and (kind == "ClusterRole" or meta.get("namespace") == namespace)
            ):
                return obj
        return None

    def rules_for(self, user: str, namespace: str | None) -> list[dict[str, Any]]:
        """The rules that apply to ``user`` for a request in ``namespace`` (None: cluster-scoped)."""
        rules: list[dict[str, Any]] = []
        for binding in self.objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if user not in [_subject_user(s) for s in binding.get("subjects", [])]:
                continue
            if binding["kind"] == "RoleBinding" and binding["metadata"].get("namespace") != namespace:
                continue
            ref = binding["roleRef"]
            role = self._role(ref["kind"], ref["name"], binding["metadata"].get("namespace"))
            if role is not None:
                rules += role.get("rules", [])
        return rules

    def allowed(self, user: str, verb: str, group: str, resource: str, namespace: str | None, name: str | None) -> bool:
        """True when a rule bound to ``user`` allows the request (``RuleAllows``)."""
        for rule in self.rules_for(user, namespace):
            if group not in rule.get("apiGroups", []) or resource not in rule.get("resources", []):
                continue
            if verb not in rule.get("verbs", []):
                continue
            if rule.get("resourceNames") and name not in rule["resourceNames"]:
                continue
            return True
        return False

    def review(self, user: str, attributes: dict[str, Any]) -> dict[str, Any]:
        """A SelfSubjectAccessReview's ``status`` for ``user`` and the review's ``spec.resourceAttributes``.

        As the API server answers one (``pkg/registry/authorization/selfsubjectaccessreview/rest.go``, ``Create``:
        the request's own user, ``allowed`` = the authorizer's decision is Allow, ``reason`` its reason) with the
        RBAC authorizer (``plugin/pkg/auth/authorizer/rbac/rbac.go``: on Allow the reason is ``RBAC: allowed by``
        the binding, ``rule_resolver.go``'s describers; no opinion gives ``allowed: false`` and no reason, as RBAC
        has no deny). Subresource joined to the resource by ``/`` as in :meth:`allowed`.
        """
        resource = attributes.get("resource") or ""
        if attributes.get("subresource"):
            resource += "/" + attributes["subresource"]
        namespace = attributes.get("namespace") or None
        request = (attributes.get("verb") or "", attributes.get("group") or "", resource)
        for binding in self.objects:
            if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            subjects = [s for s in binding.get("subjects", []) if _subject_user(s) == user]
            bound_in = binding["metadata"].get("namespace")
            if not subjects or (binding["kind"] == "RoleBinding" and bound_in != namespace):
                continue
            ref = binding["roleRef"]
            role = self._role(ref["kind"], ref["name"], bound_in)
            for rule in (role or {}).get("rules", []):
                verb, group, wanted = request
                if group not in rule.get("apiGroups", []) or wanted not in rule.get("resources", []):
                    continue
                if verb not in rule.get("verbs", []):
                    continue
                if rule.get("resourceNames") and attributes.get("name") not in rule["resourceNames"]:
                    continue
                subject = subjects[0]
                who = f'{subject["kind"]} "{subject["name"]}"'
                if subject["kind"] == "ServiceAccount":  # describeSubject: NAME/NAMESPACE
                    who = f'{subject["kind"]} "{subject["name"]}/{subject.get("namespace") or bound_in or ""}"'
                name = binding["metadata"]["name"]
                if binding["kind"] == "RoleBinding":  # roleBindingDescriber: NAME/NAMESPACE
                    name += f"/{bound_in}"
                reason = f'RBAC: allowed by {binding["kind"]} "{name}" of {ref["kind"]} "{ref["name"]}" to {who}'
                return {"allowed": True, "reason": reason}
        return {"allowed": False}

    def forbidden_message(
        self, user: str, verb: str, group: str, resource: str, namespace: str | None, name: str | None
    ) -> str:
        """The API server's Forbidden message (``apiserver/pkg/endpoints/handlers/responsewriters/errors.go``)."""
        plural, _, sub = resource.partition("/")
        target = f"{plural}.{group}" if group else plural
        who = f'{target} "{name}"' if name else target
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        resource_words = f'resource "{plural}"' + (f' subresource "{sub}"' if sub else "")
        message = f'{who} is forbidden: User "{user}" cannot {verb} {resource_words} in API group "{group}" {scope}'
        self.denied.append(message)
        return message
