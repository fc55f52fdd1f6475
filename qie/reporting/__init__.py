"""What a run folder shows: `report.html` of a training run and `sweep_report.html` of a sweep, self-contained pages
(charts and pictures inline) built from the files the run wrote, so either can be rebuilt from a finished folder.
These modules read files and import no training code; the charts are written as SVG text (`charts.py`)."""
