"""Experiments out of the product (experiments/README.md): probes that answered a design question
and the scripts that measured them. They import `ddbench.*`; nothing in ddbench/, engine/ or
kernels/ imports them. Run the scripts from the repository root: `python3 -m experiments.scripts.NAME`."""
