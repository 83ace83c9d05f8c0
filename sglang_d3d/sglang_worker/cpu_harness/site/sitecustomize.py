"""Loaded by every Python process started with this folder on PYTHONPATH (the CPU test harness
puts it there for sglang's scheduler and detokenizer subprocesses): installs the import shims and
the pure-torch kernel fallbacks before sglang is imported."""

from sglang_d3d.sglang_worker.cpu_harness import install

install()
