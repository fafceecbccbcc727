"""Tools around the kernels (not shipped in the Hub variant): the CLI, the benchmark, presets."""
