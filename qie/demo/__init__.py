"""The demo: a synthetic edit data set and the end-to-end job on the tiny demo model."""
