"""aotc graph passes: IR records, lint, partition. Imports `runtime`, never `aotc`."""
