"""Every script under scripts/ is named in README.md, and every script the docs name answers
--help (the docs-truth checks that need a subprocess; the others: tests/unit/test_docs.py)."""

import re
import subprocess
import sys
from pathlib import Path

from tests.unit.test_docs import DOCS, ROOT, doc_text


def test_every_script_is_named_in_the_readme_and_answers_help():
    """One process runs each script's --help (torch imported once, not once per script)."""
    readme = doc_text(ROOT / "README.md")
    scripts = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").glob("*.py"))
    assert [s for s in scripts if Path(s).name not in readme] == [], "not named in README.md"
    named = {s for doc in DOCS for s in re.findall(r"scripts/\w+\.py", doc_text(doc))}
    program = (
        "import runpy, sys\n"
        "bad = []\n"
        "for script in sys.argv[1:]:\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "        bad.append(script + ': no exit')\n"
        "    except SystemExit as e:\n"
        "        bad += [] if e.code in (0, None) else [f'{script}: exit {e.code}']\n"
        "print('BAD', bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program, *sorted(named | set(scripts))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "BAD []", proc.stdout[-3000:]
