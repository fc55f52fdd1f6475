"""`python -m qie.studio`: a local web page over qie's stages and a job queue.

A job is a qie command line (`python -m qie.<stage> OVERRIDES hydra.run.dir=FOLDER`), validated as the CLI would
before it is queued, run as a subprocess, and watched through the files its run folder holds (`metrics.jsonl`,
`validation/`, `report.html`, `eval.json`). The queue is a SQLite database under `studio.home`.

Modules: `queue` (the database), `runner` (the subprocesses), `commands` (a job's command and its validation),
`forms` (the settings' form from the schemas), `runs` (reading run folders), `datasets` (the data tab), `guard`
(tokens, origins, confined paths), `app` (the routes), `server` (uvicorn). Nothing outside this package imports it.
"""
