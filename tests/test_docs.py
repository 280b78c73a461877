"""The README stays true: every run parameter is documented, and the CI entry is the test command."""

from pathlib import Path

from captionflow.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def test_every_parameter_is_in_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [name for name in RunConfig.model_fields if f"`{name}`" not in readme]
    assert not missing, f"README's parameter table lacks {missing}"


def test_every_command_prints_its_help(capsys):
    import pytest

    from captionflow.cli import main

    helps = {}
    for command in ([], ["run"], ["compare"], ["deploy"], ["watch"], ["build-model"], ["demo-data"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        out = helps[" ".join(command)] = capsys.readouterr().out
        assert out.startswith("usage: captionflow"), (command, out[:200])
    missing = [n for n in RunConfig.model_fields if "--" + n.replace("_", "-") not in helps["run"]]
    assert not missing, f"`captionflow run --help` lacks {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test" in readme and "make run" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]


def test_presets_keep_the_engine_fed():
    from captionflow.presets import PRESETS

    for p in PRESETS.values():
        # enough requests in flight per replica to fill the vLLM scheduler
        assert p.batch_size * p.max_concurrent_batches >= p.max_num_seqs, p.name
