"""Statistics that drift detection and recalibration both use: plain functions, no Celery, no
database (the request-clustered proportions, robust evidence across witnesses, synthetic
test data)."""
