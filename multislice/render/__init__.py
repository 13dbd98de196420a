"""Rendering: the Kubernetes objects of a plan (JobSet, Kueue, RBAC, trainer Jobs), validated against their CRDs."""
