"""The plan step lists a stage's ``hf://`` globs with the Hugging Face token its training pods get, on KFP (the
stage's Kubernetes Secret, mounted into the plan task as into the trainer pods) and with a Secret Manager version
(read as the trainer pods read it): a private dataset the pods can read is not refused at plan. The Hub is the
loopback fake of tests/hf_hub.py; Secret Manager the one of tests/fakes.py."""

from __future__ import annotations

import copy

import pytest

from multislice import config
from multislice.config import data, hub
from multislice.delivery import targets
from multislice.plan import make_plan
from multislice.render import jobset as render_jobset
from multislice.steps import plan as plan_step
from multislice.trainer import hub_token
from tests.fakes import FakeServer
from tests.hf_hub import FakeHub

PRIVATE = "hf://datasets/me/private/data/*.parquet"
SECRET, TOKEN = "hf-data-token", "hf_token_of_me"
VERSION = "projects/team-project/secrets/hf-token/versions/1"


def gke_profile(**token_source):
    """The GKE profile, every stage's data a private ``hf://`` Parquet glob read with ``token_source``."""
    profile = copy.deepcopy(config.read_profile("gke-v6e-16x2-seed"))
    profile["output_dir"] = "gs://bucket/out"
    profile.pop("example_stages", None)
    for entry in profile["stages"]:
        entry["data"] = {"kind": "grain", "file_type": "parquet", "train_files": PRIVATE, **token_source}
        entry["eval_interval"] = -1
        entry.pop("export", None)
        entry.pop("elastic", None)  # an elastic stage reads ArrayRecord only
    return profile


@pytest.fixture
def fake_hub(monkeypatch):
    with FakeHub({"me/private": {"main": ["data/train-0.parquet"]}}, private={"me/private": TOKEN}) as served:
        monkeypatch.setenv(hub.ENDPOINT_ENV, served.endpoint)
        monkeypatch.delenv(hub.TOKEN_ENV, raising=False)
        yield served


def test_the_plan_lists_with_the_kubernetes_secret_token_the_kfp_pipeline_mounts(fake_hub, monkeypatch):
    spec = config.load_spec(gke_profile(hf_token_kubernetes_secret=SECRET))
    refused = data.data_issues(spec, None, plan_step.stage_hub_tokens(spec))
    assert refused and all(field.endswith("data.train_files") for field, _ in refused)  # no token in the pod
    monkeypatch.setenv(hub.plan_token_env(SECRET), TOKEN)  # what KFP puts in the plan pod from the Secret
    assert data.data_issues(spec, None, plan_step.stage_hub_tokens(spec)) == []
    assert fake_hub.requests[-1][1] == f"Bearer {TOKEN}"


def test_the_plan_lists_with_the_secret_manager_token_the_trainer_pods_read(fake_hub, monkeypatch):
    from google.auth.credentials import AnonymousCredentials

    spec = config.load_spec(gke_profile(hf_token_secret=VERSION))
    with FakeServer() as server:
        monkeypatch.setattr(hub_token, "SECRET_MANAGER_ENDPOINT", server.url)
        monkeypatch.setattr("google.auth.default", lambda scopes=None: (AnonymousCredentials(), "team-project"))
        server.state.secrets[VERSION] = f"{TOKEN}\n".encode()
        assert data.data_issues(spec, None, plan_step.stage_hub_tokens(spec)) == []
        assert fake_hub.requests[-1][1] == f"Bearer {TOKEN}"
        del server.state.secrets[VERSION]
        with pytest.raises(config.ConfigError) as refused:
            plan_step.stage_hub_tokens(spec)
    message = str(refused.value)
    assert "data.hf_token_secret" in message and "roles/secretmanager.secretAccessor" in message
    assert TOKEN not in message


def test_the_compiled_kfp_plan_tasks_get_the_token_from_the_secret_the_training_pods_read(tmp_path):
    """The trainer container reads key ``token`` of the stage's Secret (``secretKeyRef``); every plan task of the
    compiled KFP pipeline gets the same key of the same Secret (kfp-kubernetes ``secretAsEnv``), into the variable
    the plan step reads."""
    from pipelines.multislice_training import compile_pipeline

    profile = gke_profile(hf_token_kubernetes_secret=SECRET)
    plan = make_plan(config.load_spec(profile))
    [pod_env] = render_jobset.data_token_env(plan, plan.stages[0])
    assert pod_env["valueFrom"]["secretKeyRef"] == {"name": SECRET, "key": "token"}
    output = tmp_path / "pipeline.yaml"
    compile_pipeline(profile, str(output), target="kfp")
    spec, platform = targets.documents(output)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    root = spec["root"]["dag"]["tasks"]["exit-handler-1"]["componentRef"]["name"]
    tasks = spec["components"][root]["dag"]["tasks"]
    plans = [task for name, task in tasks.items() if name.startswith("plan")]
    assert len(plans) == len(plan.stages)
    for task in plans:
        label = spec["components"][task["componentRef"]["name"]]["executorLabel"]
        [mounted] = executors[label]["secretAsEnv"]
        assert mounted["secretName"] == SECRET and mounted.get("optional") is True
        assert mounted["keyToEnv"] == [{"secretKey": "token", "envVar": hub.plan_token_env(SECRET)}]
    others = [t for name, t in tasks.items() if not name.startswith("plan")]
    for task in others:  # only the plan tasks: the other steps list nothing on the Hub
        label = spec["components"][task["componentRef"]["name"]]["executorLabel"]
        assert not any(m["secretName"] == SECRET for m in executors.get(label, {}).get("secretAsEnv", []))
