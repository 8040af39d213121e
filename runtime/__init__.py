"""aotc runtime: runs compiled artifacts. Imports neither `aotc` nor `passes`."""
