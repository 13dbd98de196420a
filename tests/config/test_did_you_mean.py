"""A misspelt ``--set`` key or profile name gets "did you mean" with the key as it is written (issue 44)."""

import pytest

from multislice import cli, config
from multislice.config import ConfigError


@pytest.mark.parametrize(
    ("key", "field", "meant"),
    [
        ("trainr_image", "trainr_image", "trainer_image"),  # a pipeline parameter's name
        ("output_dri", "output_dri", "output_dir"),
        ("stage1_stepz", "stage1_stepz", "stage1_steps"),
        ("cluster.projct", "cluster.projct", "cluster.project"),
        ("stages.0.maxtext_overridez.a", "stages[0] (tiny-8b-recipe).maxtext_overridez", "stages.0.maxtext_overrides"),
    ],
)
def test_a_misspelt_set_key_names_the_key_it_meant(key, field, meant):
    with pytest.raises(ConfigError) as raised:
        config.load_profile("local", {key: 1})
    assert dict(raised.value.issues)[field].startswith(f"unknown field; did you mean {meant}?")


def test_a_key_like_no_field_gets_no_guess():
    with pytest.raises(ConfigError) as raised:
        config.load_profile("local", {"zzzz": 1})
    assert raised.value.issues == [("zzzz", "unknown field; check its spelling (the fields are in "
                                            "multislice/config/models.py)")]  # fmt: skip


def test_a_misspelt_profile_name_names_the_profile_it_meant(capsys):
    assert cli.main(["plan", "--profile", "gke-v6e-16x2-sed"]) == 2
    assert "no profile 'gke-v6e-16x2-sed'; did you mean gke-v6e-16x2-seed? known profiles: " in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no profile 'lcoal'; did you mean local?"):
        config.read_profile("lcoal")
