"""The CI typing check: mypy sees the installed package's public signatures (PEP 561).

``user_script.py`` must type-check cleanly, and mypy must report an error on every line of ``type_errors.py``
marked ``# E`` (and on no other line), so that a package whose annotations mypy cannot see (no ``py.typed``,
everything ``Any``) fails here. Run it from outside the repository, so that mypy checks the installed wheel
and not the source tree: ``python .ci/typing/check_typing.py``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    origin = importlib.util.find_spec("icrl_kernels").origin  # where mypy finds it too; nothing imported
    if Path(origin).resolve().parent == HERE.parent.parent / "icrl_kernels":
        print(f"icrl_kernels would come from the source tree ({origin}), not an installed wheel")
        return 1
    # One mypy run over both files (mypy's analysis of torch is most of the time; there is no cache in CI).
    command = [sys.executable, "-m", "mypy", "--config-file", str(HERE / "mypy.ini"), "--no-incremental",
               str(HERE / "user_script.py"), str(HERE / "type_errors.py")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd="/")
    output = result.stdout + result.stderr
    errors = [(m.group(1), int(m.group(2))) for m in re.finditer(r"(\w+)\.py:(\d+): error:", output)]
    lines = (HERE / "type_errors.py").read_text().splitlines()
    expected = {number for number, line in enumerate(lines, 1) if re.search(r"#\s*E:", line)}
    reported = {line for file, line in errors if file == "type_errors"}
    if any(file != "type_errors" for file, _ in errors) or reported != expected:
        print(f"mypy: user_script.py must be clean and type_errors.py must have errors on lines {sorted(expected)}:")
        print(output)
        return 1
    print(f"typing check passed: user_script.py clean, the {len(expected)} deliberate errors reported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
