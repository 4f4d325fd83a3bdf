"""Optional dependencies: import one, or stop with one line naming the extra that installs it.

The core install (`pip install pipeline`) reads, plans and feeds; what only some users need is an
extra (pyproject.toml): `tokenizers` (SentencePiece, Hugging Face), `chat`, `plot`, `train`
(the reference trainer), `beam`, `gcs`. `parquet` and `metrics` name what the core's own
dependencies bring already (TFDS pyarrow, Orbax prometheus_client); their error shows only
after `pip install --no-deps`, as into MaxText's environment. `make setup` installs them all.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from pipeline.errors import MissingExtraError


def require(module: str, extra: str, needed_for: str) -> ModuleType:
    """`import module`, or a `MissingExtraError` naming `extra` if its package is absent.

    Only the absence of the package itself becomes that error; an import failing inside an
    installed package is a real fault and keeps its traceback.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.partition(".")[0]
        if error.name is None or error.name.partition(".")[0] != top:
            raise
        raise _missing(top, extra, needed_for) from None


def require_installed(module: str, extra: str, needed_for: str) -> None:
    """`require` without importing `module` (whose import may log or cost): a
    `MissingExtraError` naming `extra` if it is not installed."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, extra, needed_for)


def _missing(package: str, extra: str, needed_for: str) -> MissingExtraError:
    return MissingExtraError(
        f"{needed_for} needs {package}, which is not installed: pip install 'pipeline[{extra}]'"
    )
