"""Set up every pytest run in this repository (the kit's, ``make test``'s, a single file's).

The example out-of-tree engine in ``tests/fixtures/example_engine`` (and its variants broken on
purpose) is a test fixture and is never installed, so a user's ``engine-core plugins`` does not
list it. Tests see it through ``ENGINE_CORE_EXTRA_PLUGINS`` instead, with its folder on
``sys.path`` and ``PYTHONPATH``. This is done at import time, before any test runs: worker
processes started by the kit (spawned: they inherit ``os.environ`` and ``sys.path``) and pytest
subprocesses (they inherit ``os.environ``) find it too. It lives at the root, not in ``tests/``,
because pytest loads a conftest only for the paths it collects, and the kit is also run as
``pytest engine_core/testing/contract.py --engine-core-backend=example``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine_core.settings import ENV_EXTRA_PLUGINS

EXAMPLE_ENGINE = Path(__file__).parent / "tests" / "fixtures" / "example_engine"
EXAMPLE_PLUGIN = ("example", "engine_core_example.plugin")


def _use_example_engine() -> None:
    folder = str(EXAMPLE_ENGINE)
    if folder not in sys.path:
        sys.path.append(folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])
    extra = os.environ.get(ENV_EXTRA_PLUGINS, "").strip().strip(",")
    if EXAMPLE_PLUGIN[0] not in {item.partition("=")[0].strip() for item in extra.split(",")}:
        os.environ[ENV_EXTRA_PLUGINS] = ",".join(filter(None, [extra, "=".join(EXAMPLE_PLUGIN)]))


_use_example_engine()
