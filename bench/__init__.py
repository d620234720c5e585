"""Benchmarks and seed sweeps (bench/README.md). Run each from the repository root as a module,
`python -m bench.NAME` (`torchrun ... -m bench.update`), so that the repository's modules import."""
