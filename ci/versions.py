"""The known bug x torch version table (tests/version_table.py), from a directory of --report-json files:

    python ci/versions.py versions-out [--markdown table.md] [--expect 2.4.1,2.13.0,2.14.1]
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's tests package

from tests.version_table import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
