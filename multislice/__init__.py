"""multislice-pipelines: multislice TPU training as Kubeflow Pipelines, from config to verified checkpoint.

config -> plan -> manifests -> backend -> steps -> pipeline; see README.md.
"""
