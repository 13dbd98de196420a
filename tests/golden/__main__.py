"""``python -m tests.golden``: regenerate the golden files (``make goldens``)."""

from tests.golden import regenerate

for path in regenerate():
    print(path)
