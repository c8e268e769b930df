"""Statistics behind drift alerts and recalibration: plain functions, no Celery, no database."""
