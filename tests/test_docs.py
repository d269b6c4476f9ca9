"""Every fenced code block of README.md and docs/*.md is run here, or proven to be what another
test runs; the README stays short and links every page; every relative link resolves.

The line right before each fence says how its block is checked, in an HTML comment (GitHub does
not show it)::

    <!-- doc-test: exec [name=N] [after=A,B] [setup=S] [check=C] -->
        Run in this process, in a fresh namespace (CPU, one thread): the blocks named by ``after``
        first (each with its own ``after`` and ``setup``), then ``SETUPS[S]``, the block, and
        ``CHECKS[C]``. ``name`` lets other blocks build on this one (the README's ``GPT``).
    <!-- doc-test: distributed W [name=N] [after=...] [setup=S] [check=C] -->
        The same on W (at most 4) gloo processes (``tests/distributed.py``), every rank in one
        shared temporary directory with ``LOCAL_RANK`` set. A distributed block whose ``after``
        names another distributed block runs in that block's processes, right after it, so the
        two share one launch (the Fabric loop, then ``capture_step`` on its model).
    <!-- doc-test: shell -->
        Every line a command (``python`` is this interpreter), run in a temporary directory with
        the repository on ``PYTHONPATH``; each must exit with 0.
    <!-- doc-test: covered-by tests/FILE.py::TEST [file=PATH] -->
        The block is a command or a file that TEST runs: the test exists, its file names the
        block's script (or ``file``, or the page), every repository path in the block exists and
        every shell script it runs parses; a YAML block parses and is part of ``file``.
    <!-- doc-test: this-suite -->
        The command that runs this test suite: its script parses and pytest collects ``tests/``.
    <!-- doc-test: paths -->
        The layout of the package: every directory and module it names exists, and every module of
        every package directory is named.

Setups and checks are source text (below), so that the spawned ranks run them too; a block's code
is compiled under its page's path and line numbers, so a traceback points into the page.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, *PAGES]
README_MAX_LINES = 250
KINDS = {"exec", "distributed", "shell", "covered-by", "this-suite", "paths"}
OPTIONS = {"exec": {"name", "after", "setup", "check"}, "distributed": {"name", "after", "setup", "check"},
           "covered-by": {"file"}, "shell": set(), "this-suite": set(), "paths": set()}
TAG = re.compile(r"^<!-- doc-test: (?P<spec>.*?) -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.(?:py|ya?ml|sh|md|json|toml))\b")


# -- hidden setups and checks (source text: the spawned ranks run them too) -----------------------
SETUPS = {
    # The Fabric loop's data: token batches, the same on every rank (every stage must see the batch).
    "fabric_data": """
_g = torch.Generator().manual_seed(0)
def _batch():
    tokens = torch.randint(0, 256, (8, 17), generator=_g)
    return tokens[:, :-1], tokens[:, 1:]
loader = [_batch() for _ in range(2)]
val_batch = _batch()
torch.manual_seed(0)
""",
    # build_pipeline's model and batch: the README's GPT.
    "runtime": """
torch.manual_seed(0)
model = GPT()
_tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
batch = (_tokens[:, :-1], _tokens[:, 1:])
""",
}

CHECKS = {
    # The quick start's model on one device: forward, training_step and pipeline_predict.
    "gpt": """
_model = GPT()
_x = torch.randint(0, 256, (2, 5))
assert _model(_x).shape == (2, 5, 256)
assert _model.training_step((_x, _x), 0).ndim == 0
assert _model.pipeline_predict(_model(_x), (_x, _x)).shape == (2, 5)
assert len(_model.pipeline_layers()) == 6
""",
    "trainer": """
assert isinstance(trainer.strategy, lightning_pp.PipelineStrategy) and trainer.world_size == 4
""",
    "config": """
assert (config.schedule, config.pipeline_parallel_size, config.virtual_pipeline_size) == ("zbv", 2, 2)
assert "Use num_microbatches=2 or 4" in message, message
""",
    # The custom MoE layer runs forward and backward on one process (tests/test_custom_moe.py
    # trains it at pp=2 x ep=2).
    "moe": """
torch.manual_seed(0)
_block = MyMoEBlock(hidden=8, ffn_hidden=12, num_experts=4, top_k=2)
_x = torch.randn(2, 5, 8)
_out = _block(_x)
assert _out.shape == _x.shape
_out.square().sum().backward()
assert _block.router.weight.grad is not None and _block.norm.weight.grad is not None
""",
    # The litgpt layers reproduce litgpt's own forward, and the loss is a (sum, count) pair.
    "litgpt": """
import torch
torch.manual_seed(0)
_llm = MyLLM()
_tokens = torch.randint(0, 1000, (2, 9))
_x = _llm.pipeline_inputs(_tokens)
_out = _x
for _layer in _llm.pipeline_layers():
    _out = _layer(*_out) if isinstance(_out, tuple) else _layer(_out)
torch.testing.assert_close(_out, _llm.model(_x))
_loss_sum, _count = _llm.pipeline_loss(_out, _tokens)
assert _loss_sum.ndim == 0 and int(_count) == 2 * 8
""",
    # The plan of schedule-plans.md, run as the runtime runs it (microbatch 0's forward, then its
    # backward fused with microbatch 1's forward, then microbatch 1's backward), gives the
    # gradients of one plain backward over both microbatches.
    "plan": """
import copy
import torch

class _Block(MyBlock):
    def __init__(self):
        super().__init__()
        self.attention = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return self.mlp(self.attention(x))

torch.manual_seed(0)
_blk = _Block()
_ref = copy.deepcopy(_blk)
_x0, _x1 = torch.randn(3, 4), torch.randn(3, 4)
_sent, _sent_back = [], []
_p0, _p1 = _blk.build_schedule_plan(_x0), _blk.build_schedule_plan(_x1)
_y0, _ = MyPlan.run(_p0, None, post_forward=_sent.append)
_y1, _g0 = MyPlan.run(_p1, _p0, grad=(torch.ones(3, 4),), post_forward=_sent.append, post_backward=_sent_back.append)
_, _g1 = MyPlan.run(None, _p1, grad=(torch.ones(3, 4),), post_backward=_sent_back.append)
assert len(_sent) == 2 and len(_sent_back) == 2
(_ref(_x0).sum() + _ref(_x1).sum()).backward()
torch.testing.assert_close(_y0[0], _ref(_x0).detach())
for (_name, _p), _q in zip(_blk.named_parameters(), _ref.parameters()):
    torch.testing.assert_close(_p.grad, _q.grad, msg=_name)
""",
    "simulate": """
assert uneven.bubble_fraction > even.bubble_fraction > 0
""",
    "monitor": """
assert any(isinstance(c, PipelineMonitor) for c in trainer.callbacks) and trainer.world_size == 2
""",
}


# -- the blocks -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    spec: Optional[str]  # the tag's text, None if the block has no tag

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def words(self) -> list[str]:
        return (self.spec or "").split()

    @property
    def kind(self) -> Optional[str]:
        return self.words[0] if self.words else None

    @property
    def args(self) -> list[str]:
        return [w for w in self.words[1:] if "=" not in w]

    @property
    def options(self) -> dict[str, str]:
        return dict(w.split("=", 1) for w in self.words[1:] if "=" in w)

    @property
    def after(self) -> list[str]:
        return [n for n in self.options.get("after", "").split(",") if n]

    @property
    def world(self) -> int:
        return int(self.args[0])

    def source(self) -> str:
        """The code, shifted to its lines in the page (tracebacks then point into the page)."""
        return "\n" * self.line + self.code


def parse_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        tag = TAG.match(lines[i - 1].strip()) if i else None
        blocks.append(Block(page, i + 1, fence["lang"], "\n".join(lines[i + 1:end]) + "\n",
                            tag["spec"] if tag else None))
        i = end + 1
    return blocks


BLOCKS = [b for page in DOCS for b in parse_blocks(page)]
NAMED = {b.options["name"]: b for b in BLOCKS if "name" in b.options}


def _of_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def _rides_along(block: Block) -> bool:
    """A distributed block that runs in the processes of the distributed block it comes after."""
    return block.kind == "distributed" and any(NAMED.get(n) is not None and NAMED[n].kind == "distributed"
                                                for n in block.after)


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def prerequisites(block: Block) -> list[tuple[str, str]]:
    """(filename, source) to run before ``block``'s own code: its ``after`` chain, then its setup."""
    sources: list[tuple[str, str]] = []
    for name in block.after:
        dep = NAMED[name]
        sources += prerequisites(dep) + [(str(dep.page), dep.source())]
    if "setup" in block.options:
        sources.append((f"<tests/test_docs.py SETUPS[{block.options['setup']!r}]>", SETUPS[block.options["setup"]]))
    return sources


def program(block: Block, with_prerequisites: bool = True) -> list[tuple[str, str]]:
    """Everything a run of ``block`` executes, in order, in one namespace."""
    sources = prerequisites(block) if with_prerequisites else (
        [(f"<tests/test_docs.py SETUPS[{block.options['setup']!r}]>", SETUPS[block.options["setup"]])]
        if "setup" in block.options else [])
    sources.append((str(block.page), block.source()))
    if "check" in block.options:
        sources.append((f"<tests/test_docs.py CHECKS[{block.options['check']!r}]>", CHECKS[block.options["check"]]))
    return sources


def run_sources(sources: list[tuple[str, str]]) -> dict:
    namespace: dict = {"__name__": "__doc_test__"}
    for filename, source in sources:
        exec(compile(source, filename, "exec"), namespace)
    return namespace


# -- every block is tagged, and its tag is one this file knows -------------------------------------
def test_every_code_block_has_a_valid_tag():
    problems = []
    for b in BLOCKS:
        if b.spec is None:
            problems.append(f"{b.where}: no <!-- doc-test: ... --> line right before the fence")
            continue
        if b.kind not in KINDS:
            problems.append(f"{b.where}: unknown kind {b.kind!r} (known: {', '.join(sorted(KINDS))})")
            continue
        unknown = set(b.options) - OPTIONS[b.kind]
        if unknown:
            problems.append(f"{b.where}: option(s) {sorted(unknown)} are not for {b.kind}")
        if b.kind in ("exec", "distributed") and b.lang != "python":
            problems.append(f"{b.where}: {b.kind} needs a python block, not {b.lang!r}")
        if b.kind == "distributed" and not (len(b.args) == 1 and b.args[0].isdigit() and 1 <= int(b.args[0]) <= 4):
            problems.append(f"{b.where}: distributed needs a process count from 1 to 4")
        if b.kind == "covered-by" and not (len(b.args) == 1 and "::" in b.args[0]):
            problems.append(f"{b.where}: covered-by needs tests/FILE.py::TEST")
        if b.kind == "shell" and b.lang != "bash":
            problems.append(f"{b.where}: shell needs a bash block")
        for name in b.after:
            if name not in NAMED:
                problems.append(f"{b.where}: after={name}: no block has name={name}")
            elif NAMED[name].kind not in ("exec", "distributed"):
                problems.append(f"{b.where}: after={name}: that block is not python that runs")
            elif NAMED[name].kind == "distributed" and (b.kind != "distributed" or len(b.after) != 1
                                                         or NAMED[name].world != b.world):
                problems.append(f"{b.where}: after a distributed block only one distributed block of its size may come")
        for key, table in (("setup", SETUPS), ("check", CHECKS)):
            if key in b.options and b.options[key] not in table:
                problems.append(f"{b.where}: {key}={b.options[key]} is not in tests/test_docs.py's {key.upper()}S")
    for key, table in (("setup", SETUPS), ("check", CHECKS)):
        unused = set(table) - {b.options.get(key) for b in BLOCKS}
        problems += [f"tests/test_docs.py: {key.upper()}S[{name!r}] is used by no block" for name in sorted(unused)]
    names = [b.options["name"] for b in BLOCKS if "name" in b.options]
    problems += [f"name={n} is given to more than one block" for n in sorted({n for n in names if names.count(n) > 1})]
    assert not problems, "\n".join(problems)
    assert BLOCKS and all(b.kind in KINDS for b in BLOCKS)


# -- python blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block", _of_kind("exec"), ids=_ids(_of_kind("exec")))
def test_exec_block_runs(block, tmp_path, monkeypatch):
    _skip_without_its_extra(program(block))
    monkeypatch.chdir(tmp_path)
    run_sources(program(block))


OPTIONAL = ("litgpt", "transformers", "litdata")  # the extras' libraries (not all share one environment)


def _skip_without_its_extra(sources: list[tuple[str, str]]) -> None:
    """Skip a block that imports an optional library this environment lacks: litgpt is not in the
    suite's environment (its huggingface-hub pin excludes current transformers); .ci/run runs the
    integrations in a second one (docs/integrations.md, "Versions tested")."""
    import importlib.util

    code = "\n".join(text for _, text in sources)
    for name in OPTIONAL:
        if re.search(rf"^\s*(from|import) {name}\b", code, re.M) and importlib.util.find_spec(name) is None:
            pytest.skip(f"needs {name}, not installed here (docs/integrations.md, 'Versions tested')")


def _run_on_rank(rank, world, sources, workdir):
    os.environ["LOCAL_RANK"] = str(rank)
    os.chdir(workdir)
    run_sources(sources)
    return rank


DISTRIBUTED = [b for b in _of_kind("distributed") if not _rides_along(b)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", DISTRIBUTED, ids=_ids(DISTRIBUTED))
def test_distributed_block_runs(block, tmp_path):
    sources = program(block)
    _skip_without_its_extra(sources)
    riders = [b for b in _of_kind("distributed") if _rides_along(b) and block.options.get("name") in b.after]
    for rider in riders:
        sources += program(rider, with_prerequisites=False)
    assert run_distributed(_run_on_rank, block.world, sources, str(tmp_path), timeout=180) == list(range(block.world))


# -- commands ---------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", _of_kind("shell"), ids=_ids(_of_kind("shell")))
def test_shell_block_runs(block, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    commands = [argv for argv in (shlex.split(line, comments=True) for line in block.code.splitlines()) if argv]
    assert commands, f"{block.where}: no command"
    for argv in commands:
        assert argv[0] == "python", f"{block.where}: only python commands run here, not {argv[0]!r}"
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"{block.where}: {shlex.join(argv)} exited with {proc.returncode}:\n" + \
            proc.stdout[-2000:] + proc.stderr[-2000:]


def _shell_scripts_parse(block: Block) -> None:
    for script in re.findall(r"\bbash\s+(\S+\.sh)\b", block.code):
        assert (ROOT / script).is_file(), f"{block.where}: {script} does not exist"
        proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{block.where}: {script} does not parse: {proc.stderr}"


def _is_part_of(part, whole) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _is_part_of(v, whole[k]) for k, v in part.items())
    return part == whole


@pytest.mark.parametrize("block", _of_kind("covered-by"), ids=_ids(_of_kind("covered-by")))
def test_covered_block_is_what_its_test_runs(block):
    test_file, test_name = block.args[0].split("::")
    path = ROOT / test_file
    assert path.is_file(), f"{block.where}: {test_file} does not exist"
    text = path.read_text()
    assert re.search(rf"^def {re.escape(test_name)}\(", text, re.M), f"{block.where}: {test_file} has no {test_name}"
    repo_paths = REPO_PATH.findall(block.code) + ([block.options["file"]] if "file" in block.options else [])
    for repo_path in repo_paths:
        assert (ROOT / repo_path).exists(), f"{block.where}: {repo_path} does not exist"
    page = block.page.relative_to(ROOT)
    mentions = [Path(p).name for p in repo_paths] + [str(page), page.stem if page.parent.name == "docs" else "README"]
    assert any(m in text for m in mentions), f"{block.where}: {test_file} mentions none of {mentions}"
    _shell_scripts_parse(block)
    if block.lang == "yaml":
        parsed = yaml.safe_load(block.code)
        assert isinstance(parsed, dict), f"{block.where}: not a YAML mapping"
        if "file" in block.options:
            whole = yaml.safe_load((ROOT / block.options["file"]).read_text())
            assert _is_part_of(parsed, whole), f"{block.where}: not part of {block.options['file']}"


@pytest.mark.parametrize("block", _of_kind("this-suite"), ids=_ids(_of_kind("this-suite")))
def test_the_suite_command_is_this_suite(block):
    assert re.search(r"(^|\s)\S*python -m pytest\b", block.code), f"{block.where}: not a pytest command"
    _shell_scripts_parse(block)
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    assert re.search(r'^testpaths = \["tests"\]', pyproject, re.M) and Path(__file__).parent == ROOT / "tests"


# -- the layout of the package ----------------------------------------------------------------------
def _layout_entries(block: Block) -> dict[str, str]:
    entries: dict[str, str] = {}
    current = None
    for line in block.code.splitlines():
        if line[:1].strip():
            current, _, rest = line.partition(" ")
            entries[current] = rest
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("block", _of_kind("paths"), ids=_ids(_of_kind("paths")))
def test_layout_names_every_module(block):
    entries = _layout_entries(block)
    problems = []
    for directory, text in entries.items():
        folder = ROOT / directory
        if not folder.is_dir():
            problems.append(f"{directory} is not a directory")
            continue
        named = set(re.findall(r"\b\w+\.py\b", text))
        problems += [f"{directory}{name} does not exist" for name in sorted(named) if not (folder / name).is_file()]
        if directory.startswith("lightning_pp"):
            modules = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
            problems += [f"{directory}{name} is not named" for name in sorted(modules - named)]
    packages = {f"{p.parent.relative_to(ROOT)}/" for p in (ROOT / "lightning_pp").rglob("__init__.py")}
    problems += [f"package {p} is not listed" for p in sorted(packages - set(entries))]
    assert not problems, f"{block.where}: " + "; ".join(problems)


# -- the pages and their links ----------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page))


def test_readme_is_short_and_links_every_page():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES}: move detail to docs/"
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README) if not t.startswith(("http", "#"))}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert PAGES and not missing, f"docs pages not linked from README.md: {missing}"


def test_every_relative_link_resolves():
    broken = []
    for page in DOCS:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            path = (page.parent / file_part).resolve() if file_part else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {path.name})")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_page_has_a_title_and_links_back(page):
    lines = page.read_text().splitlines()
    assert lines and lines[0].startswith("# "), f"{page.name}: the first line must be its title"
    assert any("](../README.md)" in line for line in lines[1:4]), f"{page.name}: link back to the README under the title"
