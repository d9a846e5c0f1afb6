#!/usr/bin/env sh
# System tools some tests use (the agentenv sandbox backends). Where they cannot be installed, those
# backends' tests are skipped with the reason; nothing else depends on them.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap runsc) >/dev/null 2>&1 \
    || echo "could not install bubblewrap/runsc; those agentenv backends will be skipped" >&2
fi
exit 0
