"""The README stays a ten-minute read, the repository's Markdown tells no development history, and the generated
configuration reference covers every key of the model. (`make docs`, run by `make test`, builds the whole site
strictly: broken links and missing pages fail there.)"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(
    r"session [0-9]|this session|other engineers|commit [0-9a-f]{7}|earlier session|start of session",
    re.IGNORECASE,
)


def _markdown_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    return [ROOT / name for name in out if (ROOT / name).is_file()]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_at_most_250_lines() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the depth into docs/"


def test_no_markdown_tells_the_projects_history() -> None:
    files = _markdown_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 5
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
            for f in files for n, line in enumerate(f.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "development history belongs in git and CHANGELOG.md:\n" + "\n".join(hits)


def test_the_history_check_can_fail() -> None:
    assert HISTORY.search("as measured at the start of session 4")
    assert HISTORY.search("this session's features")
    assert not HISTORY.search("agent sessions and their turns")


@pytest.mark.parametrize("readme", ["README.md", "docs/index.md"])
def test_the_front_pages_show_the_status_page(readme: str) -> None:
    text = (ROOT / readme).read_text()
    image = re.search(r"!\[[^\]]*\]\(([^)]+status-page\.png)\)", text)
    assert image, f"{readme} shows no status page picture"
    assert ((ROOT / readme).parent / image.group(1)).is_file()


def test_the_configuration_reference_lists_every_key() -> None:
    from pydantic import BaseModel

    from policies.config import GatewayConfig

    page = _hooks().config_reference_markdown()
    missing = []

    def walk(model: type[BaseModel], where: str) -> None:
        for name, field in model.model_fields.items():
            if f"| `{name}` |" not in page:
                missing.append(f"{where}.{name}")
            for sub in _models_in(field.annotation):
                walk(sub, f"{where}.{name}")

    walk(GatewayConfig, "")
    assert not missing, f"keys missing from the generated reference: {missing}"
    assert "| `max_model_len` | integer, > 0" in page and "**required**" in page


def _models_in(annotation: object) -> list[type]:
    from typing import get_args

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def test_the_http_api_page_lists_every_path_of_the_openapi_file() -> None:
    import yaml

    spec = yaml.safe_load((ROOT / "deploy" / "openapi.yaml").read_text())
    page = _hooks().http_api_markdown()
    assert spec["paths"]
    for path in spec["paths"]:
        assert f"| `{path}` |" in page, path
    assert '--8<-- "deploy/openapi.yaml"' in page


def test_moved_pages_leave_a_pointer_that_resolves() -> None:
    for stub in ("deploy/README.md", "deploy/OPERATIONS.md", "deploy/OBSERVABILITY.md", "deploy/RELIABILITY.md",
                 "loadtests/README.md", "pools/sim/README.md"):
        target = re.search(r"\]\(([^)]+\.md)\)", (ROOT / stub).read_text())
        assert target, stub
        assert ((ROOT / stub).parent / target.group(1)).resolve().is_file(), stub
