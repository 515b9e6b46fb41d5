"""Benchmarks (`pfppo bench ...`); each module has main(argv) -> exit status."""
