"""The interpreter the tests run under, for the commands they start through a shell.

A test that starts Python starts `sys.executable` itself; a test that runs a documented
command line (`python train.py ...`, a bash script that calls `python` or `torchrun`) writes
`write_shims(folder)` once and runs it with `with_interpreter(env, folder)`: a PATH whose first
folder holds `python` and `python3` scripts that exec `sys.executable` by its own path, then
the folder of `sys.executable` (a venv's `bin/`: its `torchrun`, `pip`). A symbolic link would
not do: a venv's interpreter reached through a link in another folder finds no `pyvenv.cfg`
beside it and runs as the base interpreter, without the venv's packages."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

NAMES = ("python", "python3")


def write_shims(folder: Path) -> Path:
    """`folder/python` and `folder/python3`, each running `sys.executable`; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        shim.chmod(0o755)
    return folder


def with_interpreter(env: dict[str, str], folder: Path | None = None) -> dict[str, str]:
    """`env` with `folder` (its shims written by `write_shims`; none: a command that runs
    only the venv's entry points, such as `torchrun`) and the interpreter's own folder first
    on PATH."""
    path = [str(folder or ""), os.path.dirname(sys.executable), env.get("PATH", "")]
    return dict(env, PATH=os.pathsep.join(p for p in path if p))
