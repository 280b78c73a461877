"""The README is a user's page and stays true; the reference pages are generated from the code."""

import re
import subprocess
import sys
from pathlib import Path

from captionflow.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def test_every_parameter_is_documented_from_the_code():
    # docs/parameters.md and docs/quarantine.md are what docs/generate.py makes of RunConfig and REASONS
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    page = (ROOT / "docs" / "parameters.md").read_text(encoding="utf-8")
    missing = [name for name in RunConfig.model_fields if f"| `{name}` |" not in page]
    assert not missing, f"docs/parameters.md lacks {missing}"


def test_readme_is_a_users_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    first_block = readme[readme.index("```bash") : readme.index("```", readme.index("```bash") + 3)]
    assert "make run" in first_block and "make test" in first_block  # the two commands come first
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated measurement history belongs to git and bench/results"


def test_code_does_not_point_into_the_readme():
    for pkg in ("captionflow", "flows", "tasks", "deployments"):
        for path in (ROOT / pkg).rglob("*.py"):
            assert "README" not in path.read_text(encoding="utf-8"), path


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test" in readme and "make run" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))] == ["make test"]
