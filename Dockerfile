# One image for the web app and the Celery worker (docker-compose.yml runs both from it).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# PyPI's Linux torch wheel pulls the CUDA libraries; for a CPU-only image build with
# --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_EXTRA_INDEX_URL=
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}

WORKDIR /app
COPY . .
RUN pip install . && useradd --create-home --uid 1000 loraplex && mkdir -p /var/lib/loraplex /models /secrets \
    && chown loraplex /var/lib/loraplex /models /secrets && chmod 700 /secrets
USER loraplex

ENV LORAPLEX_VAR_DIR=/var/lib/loraplex
# The proxies whose X-Forwarded-For names the client (uvicorn's --forwarded-allow-ips): none unless
# set; uvicorn's own default trusts 127.0.0.1 (docs/security.md, "Uploads, proxies and the platform's processes").
ENV FORWARDED_ALLOW_IPS=""
EXPOSE 8000
CMD ["uvicorn", "lora_platform.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--http", "lora_platform.asgi:HTTPProtocol"]
