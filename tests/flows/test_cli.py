"""The command line: every command prints its help, bad input is one line and exit status 2, before Ray starts."""

from __future__ import annotations

import pytest

from captionflow.config import RunConfig


def test_every_command_prints_its_help(capsys):
    from flows.cli import main

    helps = {}
    for command in ([], ["run"], ["compare"], ["deploy"], ["watch"], ["build-model"], ["demo-data"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        out = helps[" ".join(command)] = capsys.readouterr().out
        assert out.startswith("usage: captionflow"), (command, out[:200])
    missing = [n for n in RunConfig.model_fields if "--" + n.replace("_", "-") not in helps["run"]]
    assert not missing, f"`captionflow run --help` lacks {missing}"


def test_cli_reports_bad_model_and_dataset(prefect_api, tmp_path, capsys):
    import ray

    from flows.cli import main

    ray_was_up = ray.is_initialized()  # an earlier test in this process may have started it
    assert main(["run", "--output", str(tmp_path / "o"), "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--output", str(tmp_path / "o"), "--dataset", str(tmp_path / "no-such-folder")]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder" in err and "does not exist" in err
    assert ray.is_initialized() == ray_was_up  # rejected before Ray was started
    assert not (tmp_path / "o" / "runs").exists()


def test_cli_rejects_unknown_config_keys(tmp_path, capsys):
    from flows.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: builtin\n")
    assert main(["run", "--config", str(cfg)]) == 2
    assert "modle" in capsys.readouterr().err


def test_a_folder_of_only_broken_files_is_not_a_result(prefect_api, tmp_path, capsys):
    from flows.cli import main

    data = tmp_path / "broken"
    data.mkdir()
    (data / "a.jpg").write_bytes(b"")
    (data / "b.jpg").write_bytes(b"<html>not found</html>")
    out = tmp_path / "out"
    assert main(["run", "--dataset", str(data), "--output", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "none of its 2 inputs was accepted (empty_file 1, not_an_image 1" in err and "quarantine.parquet" in err
    assert not (out / "runs").exists() and not (out / "leaderboard.parquet").exists()


def test_a_malformed_config_file_is_one_line(tmp_path, capsys):
    from flows.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: builtin\n  max_tokens: [16\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"captionflow: invalid parameters: config file {cfg}:2:") and "\n" not in err


def test_the_watcher_refuses_without_a_prefect_api_and_records_nothing(tmp_path):
    """Without PREFECT_API_URL the events would go to a temporary in-process server and no run would start:
    the watcher must exit non-zero, say why, and not record the checkpoint as announced."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ckpt = tmp_path / "ckpts" / "step-1000"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile that could name a server
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "watch", str(tmp_path / "ckpts")],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PREFECT_API_URL is not set" in proc.stderr and "announced" not in proc.stdout
    assert not (tmp_path / "ckpts" / ".captionflow-announced.json").exists()


def test_version_and_json_option_errors_say_what(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("captionflow ")
    with pytest.raises(SystemExit) as e:
        main(["run", "--engine-kwargs", "[1, 2]"])
    assert e.value.code == 2 and "expected a JSON object" in capsys.readouterr().err
