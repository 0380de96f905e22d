"""What several test modules share: loopback servers, `tandem` runs, record files, fixtures and fakes.

Test modules import from here (`from support.runs import tandem_sft`) and never from one another, so a test file
can move or be deleted without breaking another. `tests/` is on `sys.path` through pytest's `pythonpath` setting
in pyproject.toml, under plain `pytest` and `python -m pytest` alike, and so in every process a test forks.
"""
