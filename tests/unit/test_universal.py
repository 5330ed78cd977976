import pytest

from wildtrain.checkpoint.universal import pattern_safe


@pytest.mark.parametrize(
    "path",
    [
        "/tmp/wildtrain-staging/step_000000100-3f9a1c-universal-k2_x/original/.step_100_universal.partial-ab12/step_100_universal"
    ],
)
def test_a_staging_path_of_wildtrain_names_is_pattern_safe(path):
    assert pattern_safe(path)


@pytest.mark.parametrize(
    "path", ["/data/run+1/ckpt", "/data/run (copy)/ckpt", "/data/run[0]/ckpt", "/data/a*b", "/data/a?b"]
)
def test_a_path_with_glob_or_regex_characters_is_not(path):
    assert not pattern_safe(path)
