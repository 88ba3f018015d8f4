"""pyproject.toml declares what the package imports, and imports what it declares."""

import ast
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

from oiq_mlx.mlx_lm.gguf import GEMMA_CHAT_TEMPLATE

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent

# Declared but never imported by oiq_mlx itself, with the reason it is needed.
USED_INDIRECTLY = {
    # transformers renders chat templates with jinja2 but lists it only as its
    # "chat-template" extra; every GGUF tokenizer here carries a template.
    "jinja2",
}
# The test extra: what runs the suite (pytest-xdist: its two workers, .ci/run).
TEST_RUNNERS = {"pytest", "pytest-xdist"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_normalize(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0]) for spec in specs}


def _imported_distributions():
    """Distributions of every third-party module imported anywhere in oiq_mlx/."""
    roots = set()
    for path in (ROOT / "oiq_mlx").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots.add(node.module.split(".")[0])
    roots -= set(sys.stdlib_module_names) | {"oiq_mlx", "__future__"}
    owners = importlib.metadata.packages_distributions()
    missing = sorted(r for r in roots if r not in owners)
    assert not missing, f"imported modules with no installed distribution: {missing}"
    # mlx is provided by "mlx" (and "mlx-cpu" on Linux): any owner declared counts
    return {root: {_normalize(d) for d in owners[root]} for root in roots}


def test_every_import_is_declared():
    declared = _declared()
    undeclared = sorted(root for root, dists in _imported_distributions().items() if not dists & declared)
    assert not undeclared, f"imported but not in pyproject.toml: {undeclared}"


def test_every_dependency_is_imported_or_explained():
    imported = set().union(*_imported_distributions().values())
    unused = sorted(_declared() - imported - TEST_RUNNERS - USED_INDIRECTLY)
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def test_chat_templates_render_through_jinja2():
    """The reason jinja2 is declared: transformers needs it to apply a chat template
    (here the Gemma template gguf.py supplies)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<bos>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(messages, chat_template=GEMMA_CHAT_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    # the renderer is jinja2's (transformers leaves this None when jinja2 is missing)
    assert chat_template_utils.jinja2 is sys.modules["jinja2"]


def test_console_scripts_resolve():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"oiq-generate", "oiq-cache-prompt", "oiq-server"}
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), target
