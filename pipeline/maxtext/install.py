"""`pipeline maxtext install`: the few edits MaxText needs, found by name, not by diff context.

MaxText moves and reformats its files often (`MaxText/`, `src/MaxText/`, `src/maxtext/`, the
installed `maxtext` package), so every edit locates its anchor in the parsed source: the
function `create_data_iterator`, the pydantic class that declares `dataset_type`, the
`dataset_type:` line of `base.yml`, the `match` case of `load_state_if_possible` that restores
a Grain iterator. Each edit is skipped when its result is already there (the command is
idempotent), and a missing anchor stops everything with one line before any file is written.
"""

from __future__ import annotations

import ast
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import InstallError
from pipeline.maxtext.keys import KEYS, MaxTextKey

LAYOUTS = ("src/maxtext", "src/MaxText", "MaxText", "maxtext", ".")
"""Where MaxText's package lives under MAXTEXT_DIR, newest layout first; `.`: MAXTEXT_DIR is
the package itself (e.g. site-packages/maxtext)."""
INTERFACE = "input_pipeline/input_pipeline_interface.py"
TAG = "pipeline maxtext install"
DISPATCH_MARK = "pipeline_maxtext.is_enabled("
ELASTIC_MARK = 'hasattr(data_iterator, "restore_from")'
SHARED_STATE_PATH = re.compile(r"isinstance\(\s*data_iterator\.local_iterator,\s*ElasticIterator")


@dataclass
class Edit:
    path: Path
    before: str
    after: str
    what: str

    def diff(self, root: Path) -> str:
        name = self.path.relative_to(root).as_posix()
        lines = difflib.unified_diff(
            self.before.splitlines(keepends=True),
            self.after.splitlines(keepends=True),
            f"a/{name}",
            f"b/{name}",
        )
        return "".join(lines)


@dataclass
class Plan:
    """What an install would do: the edits, and why the other changes are not needed."""

    root: Path
    package: Path
    edits: list[Edit]
    notes: list[str]


def find_package(root: Path) -> Path:
    if not root.is_dir():
        raise InstallError(f"{root}: not a directory (give the root of a MaxText checkout)")
    for layout in LAYOUTS:
        if (root / layout / INTERFACE).is_file():
            return (root / layout).resolve()
    where = ", ".join(f"{layout}/{INTERFACE}" for layout in LAYOUTS if layout != ".")
    raise InstallError(
        f"{root}: no MaxText input pipeline found (looked for {where} and {INTERFACE}); give "
        "the root of a MaxText checkout or the directory of the installed maxtext package"
    )


def plan_install(root: Path, *, elastic: bool = False) -> Plan:
    """Every edit, computed in memory; raises InstallError if an anchor is missing."""
    package = find_package(root)
    root = root.resolve()  # diffs name paths relative to it, and `package` is resolved
    edits, notes = [], []
    for change in (add_dispatch, declare_keys_in_types, declare_keys_in_base_yml):
        edit, note = change(package)
        edits += [edit] if edit else []
        notes += [note] if note else []
    if elastic:
        edit, note = restore_on_any_process_count(package)
        edits += [edit] if edit else []
        notes += [note] if note else []
    return Plan(root, package, edits, notes)


def apply(plan: Plan) -> None:
    for edit in plan.edits:
        edit.path.write_text(edit.after)


# -- the edits --------------------------------------------------------------------------------


def add_dispatch(package: Path) -> tuple[Edit | None, str | None]:
    """Hand `create_data_iterator` to the pipeline before MaxText's own dataset dispatch."""
    path = package / INTERFACE
    text = path.read_text()
    function = _function(path, text, "create_data_iterator")
    if DISPATCH_MARK in _source(text, function):
        return None, f"{_rel(package, path)}: the dispatch is already there"
    names = [arg.arg for arg in function.args.args]
    if len(names) < 2:
        raise InstallError(
            f"{path}: create_data_iterator takes {names}, not (config, mesh); this MaxText "
            "version is not supported by the installer (see docs/maxtext.md for the 3 lines)"
        )
    config, mesh = names[:2]
    body = function.body
    indent = " " * body[0].col_offset
    unit = " " * (body[0].col_offset - function.col_offset)
    lines = [
        f"{indent}from pipeline import maxtext as pipeline_maxtext  # added by `{TAG}`\n",
        f"{indent}if pipeline_maxtext.is_enabled({config}):\n",
        f"{indent}{unit}return pipeline_maxtext.create_data_iterator({config}, {mesh})\n",
    ]
    if _is_docstring(body[0]):
        after = _insert(text, body[0].end_lineno, ["\n", *lines])
    else:
        after = _insert(text, body[0].lineno - 1, [*lines, "\n"])
    return Edit(path, text, after, "dispatch to the pipeline in create_data_iterator"), None


def declare_keys_in_types(package: Path) -> tuple[Edit | None, str | None]:
    """Declare the keys as fields of the pydantic class that declares `dataset_type`."""
    path = package / "configs" / "types.py"
    if not path.is_file():
        return None, "no configs/types.py: this MaxText declares its keys in base.yml only"
    text = path.read_text()
    missing = [key for key in KEYS if not re.search(rf"^\s+{key.name}\s*:", text, re.M)]
    if not missing:
        return None, f"{_rel(package, path)}: the keys are already declared"
    owner = _class_declaring(path, text, "dataset_type")
    indent = " " * owner.body[-1].col_offset
    with_field = "Field(" in _source(text, owner)
    lines = [f"{indent}{_field(key, with_field)}\n" for key in missing]
    after = _insert(text, owner.end_lineno, lines)
    names = ", ".join(key.name for key in missing)
    return Edit(path, text, after, f"declare {names} in {owner.name}"), None


def declare_keys_in_base_yml(package: Path) -> tuple[Edit | None, str | None]:
    """Give the keys their defaults in base.yml, after `dataset_type:` (also what makes
    MaxText's `M_<KEY>` environment overrides see them)."""
    path = package / "configs" / "base.yml"
    if not path.is_file():
        raise InstallError(f"{path}: missing; every supported MaxText layout has configs/base.yml")
    text = path.read_text()
    missing = [key for key in KEYS if not re.search(rf"^{key.name}\s*:", text, re.M)]
    if not missing:
        return None, f"{_rel(package, path)}: the keys are already there"
    anchor = re.search(r"^dataset_type\s*:.*\n", text, re.M)
    if anchor is None:
        raise InstallError(f"{path}: no top-level 'dataset_type:' line to put the keys after")
    line = text.count("\n", 0, anchor.end())
    lines = [f"# {key.help} (added by `{TAG}`)\n{key.name}: {_yaml(key)}\n" for key in missing]
    return Edit(path, text, _insert(text, line, lines), "add the keys to base.yml"), None


def restore_on_any_process_count(package: Path) -> tuple[Edit | None, str | None]:
    """Let an older MaxText restore the pipeline's `iter` item with any number of processes.

    MaxText that restores a Grain `ElasticIterator` from one shared file needs nothing: the
    adapter's iterator takes that path (pipeline.maxtext.adapter). Older versions count the
    per-process files and refuse another count, so a `case` is added before the Grain case of
    `load_state_if_possible`'s `match`: it restores the model as the fallback case does and the
    data state from any one file (`TrainIterator.restore_from`).
    """
    sources = [package / "common" / name for name in ("grain_utility.py", "checkpointing.py")]
    sources.append(package / "checkpointing.py")
    if any(SHARED_STATE_PATH.search(path.read_text()) for path in sources if path.is_file()):
        return None, (
            "--elastic: this MaxText restores the pipeline's iterator with any number of "
            "processes already (its ElasticIterator path); no change"
        )
    path = next((p for p in sources[1:] if p.is_file()), None)
    if path is None:
        raise InstallError(f"{package}: no checkpointing.py or common/checkpointing.py")
    text = path.read_text()
    function = _function(path, text, "load_state_if_possible")
    if ELASTIC_MARK in _source(text, function):
        return None, f"{_rel(package, path)}: the elastic restore is already there"
    case = _grain_case(path, text, function)
    source = _source(text, function)
    for name in ("checkpoint_args", "Composite", "step"):
        if not re.search(rf"\b{name}\b", source):
            raise InstallError(f"{path}: load_state_if_possible has no '{name}' to restore with")
    case_line = text.splitlines()[case.pattern.lineno - 1]
    indent = case_line[: len(case_line) - len(case_line.lstrip())]
    unit = " " * (case.body[0].col_offset - len(indent))
    iter_dir = 'checkpoint_manager.directory / str(step) / "iter"'
    lines = [
        f"{indent}# The pipeline's data state is the same in every process's file: restore it\n",
        f"{indent}# with any number of processes (added by `{TAG} --elastic`).\n",
        f"{indent}case (checkpoint_manager, _, data_iterator) if {ELASTIC_MARK} and (\n",
        f"{indent}{unit}{iter_dir}\n",
        f"{indent}).exists():\n",
        f"{indent}{unit}restored = checkpoint_manager.restore(step, "
        "args=Composite(items=checkpoint_args))\n",
        f"{indent}{unit}data_iterator.restore_from({iter_dir})\n",
        f"{indent}{unit}return restored, None\n",
    ]
    first = _first_line_with_comments(text, case.pattern.lineno)
    after = _insert(text, first - 1, lines)
    return Edit(path, text, after, "restore the data state with any process count"), None


# -- helpers ----------------------------------------------------------------------------------


def _parse(path: Path, text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as error:
        raise InstallError(f"{path}:{error.lineno}: cannot parse: {error.msg}") from error


def _function(path: Path, text: str, name: str) -> ast.FunctionDef:
    for node in _parse(path, text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise InstallError(f"{path}: no top-level function {name}(); this MaxText is not supported")


def _class_declaring(path: Path, text: str, field: str) -> ast.ClassDef:
    for node in _parse(path, text).body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field
            for item in node.body
        ):
            return node
    raise InstallError(f"{path}: no class declares '{field}'; cannot tell where keys belong")


def _grain_case(path: Path, text: str, function: ast.FunctionDef) -> ast.match_case:
    for node in ast.walk(function):
        if isinstance(node, ast.Match):
            for case in node.cases:
                if case.guard is not None and '"grain"' in _source(text, case.guard):
                    return case
    raise InstallError(
        f'{path}: load_state_if_possible has no `match` case for dataset_type "grain"; '
        "restore across host counts by copying the iter/ files (docs/maxtext.md)"
    )


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)


def _source(text: str, node: ast.AST) -> str:
    return ast.get_source_segment(text, node) or ""


def _first_line_with_comments(text: str, lineno: int) -> int:
    """The first line of the comment block right above line `lineno` (1-based)."""
    lines = text.splitlines()
    first = lineno
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    return first


def _insert(text: str, after_line: int, lines: list[str]) -> str:
    """`text` with `lines` inserted after its line `after_line` (1-based; 0: at the top)."""
    kept = text.splitlines(keepends=True)
    if kept and not kept[-1].endswith("\n"):
        kept[-1] += "\n"
    return "".join(kept[:after_line] + lines + kept[after_line:])


def _field(key: MaxTextKey, with_field: bool) -> str:
    annotation = key.type.__name__
    default = repr(key.default) if key.type is not str else f'"{key.default}"'
    if with_field:
        return f'{key.name}: {annotation} = Field({default}, description="{key.help}")'
    return f"{key.name}: {annotation} = {default}  # {key.help}"


def _yaml(key: MaxTextKey) -> str:
    return str(key.default) if key.type is not str else f'"{key.default}"'


def _rel(package: Path, path: Path) -> str:
    return path.relative_to(package).as_posix()
