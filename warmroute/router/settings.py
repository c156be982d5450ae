"""Every setting of `warmroute serve`: one pydantic model, read from CLI flags > WARMROUTE_* env > YAML file > defaults.

The model is the single source of truth: the CLI flags and docs/configuration.md are both generated from it
(settings_cli.py), so a setting cannot exist in one place and not in another; settings_load.py merges the layers
into it and words its errors. The routing strategies' settings are the core's own model (core/strategies.py
StrategySettings, which RouterSettings extends): a strategy's knobs nest under its name in YAML
(`cache_aware: {balance_factor: 2}`) and keep their plain names as flags (`--balance-factor`), environment variables
(`WARMROUTE_BALANCE_FACTOR`) and top-level YAML keys. `warmroute simulate` generates its router flags from the same
model (add_setting_arguments). A setting is one line (type, default, bounds) and the docstring under it, its
description (core/settings_model.py).
"""

from __future__ import annotations

import importlib.util
import re
import ssl
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import xxhash
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from warmroute.core.admission import AdmissionConfig
from warmroute.core.kv_events import ZMQ_ENDPOINT
from warmroute.core.demand import DemandSettings
from warmroute.core.disaggregation import DisaggregationSettings
from warmroute.core.settings_model import GiB, KiB, MiB, parse_mapping, parse_size  # noqa: F401 (re-exported)
from warmroute.core.strategies import STRATEGIES, StrategyProfile, StrategySettings, check_profiles, strategy_names

ENV_PREFIX = "WARMROUTE_"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")  # safe in a header and a metric label


_K8S_SERVICE = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # [NAMESPACE/]SERVICE
_K8S_POOL = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # [NAMESPACE/]NAME


class Backend(BaseModel):
    """One upstream inference instance."""

    model_config = ConfigDict(extra="forbid")
    name: str
    url: str
    kv_capacity_tokens: int | None = Field(None, ge=256, le=10**10)
    engine_capacity: int | None = Field(None, ge=1, le=1_000_000)  # requests it runs at once; unset: the fleet's
    models: list[str] | None = Field(None, min_length=1)  # what it serves; unset: read from its /v1/models
    # precise mode (kv_events): its KV-event publisher and replay socket; unset: the URL's host at kv_events_port
    kv_events_endpoint: str | None = Field(None, pattern=ZMQ_ENDPOINT)
    kv_events_replay_endpoint: str | None = Field(None, pattern=ZMQ_ENDPOINT)
    # disaggregated serving (docs/disaggregation.md): its part, and (SGLang) its KV bootstrap server's port
    role: Literal["prefill", "decode", "both"] = "both"
    bootstrap_port: int | None = Field(None, ge=1, le=65535)

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"backend name {v!r} must be 1-63 letters, digits, '.', '_' or '-'")
        return v

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.isprintable() or " " in v:  # urlsplit silently drops CR, LF and tab: refuse them here
            raise ValueError(f"backend URL {v!r} must not contain spaces or control characters")
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"backend URL {v!r} must look like http://HOST:PORT[/PATH]")
        try:
            parts.port  # raises on a bad port
        except ValueError:
            raise ValueError(f"backend URL {v!r} has an invalid port") from None
        return v.rstrip("/")


def parse_backends(value: Any) -> list[dict]:
    """`URL`, `NAME=URL`, a comma-separated string of those, or YAML mappings -> backend dicts."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if not isinstance(value, list):
        raise ValueError("must be a list of URL or NAME=URL entries")
    out = []
    for i, item in enumerate(value):
        role = None
        if isinstance(item, str) and item.split("@", 1)[0] in ("prefill", "decode", "both"):
            role, item = item.split("@", 1)  # ROLE@URL or ROLE@NAME=URL
        if isinstance(item, str):
            name, sep, url = item.partition("=")
            item = {"name": name, "url": url} if sep and "://" not in name else {"url": item}
        if not isinstance(item, dict):
            raise ValueError(f"entry {i} must be URL, NAME=URL, or a mapping with name, url, kv_capacity_tokens, "
                             "models")
        if "name" not in item and isinstance(item.get("url"), str):
            item = {"name": name_from_url(item["url"]), **item}
        if role is not None:
            item = {**item, "role": role}
        out.append(item)
    return out


def name_from_url(url: str) -> str:
    """A backend's default name, from its URL alone (host, port, path): the same in every list it appears in
    and whatever else the list holds, so the index stays pointed at the right host."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    raw = "-".join(str(p) for p in (parts.hostname, port, parts.path.strip("/")) if p)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._") or "backend"
    if len(name) > 63:  # long host names and paths: a readable head and a digest of the whole
        name = f"{name[:54].rstrip('-._')}-{xxhash.xxh32_hexdigest(raw.encode())}"
    return name


class RouterSettings(BaseSettings, StrategySettings, DemandSettings, DisaggregationSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True, frozen=False)

    backends: Annotated[list[Backend], NoDecode] = Field(default_factory=list)
    """Upstream instances: URL or NAME=URL (a name defaults to the URL's host, port and path: http://10.0.0.5:8000 is
    10.0.0.5-8000), either prefixed with ROLE@ for disaggregated serving (prefill@http://10.0.0.5:8000). Repeat the
    flag; in env, separate with commas; in YAML, a list of URLs or of mappings with name, url, kv_capacity_tokens,
    engine_capacity, models, role (prefill, decode, both) and bootstrap_port (SGLang's)."""
    backends_file: str | None = None
    """A YAML file listing more backends (the same forms as `backends`, as a list or under a `backends:` key), re-read
    when it changes and on SIGHUP; entries that disappear are drained and removed once idle."""
    backends_file_interval: float = Field(1.0, ge=0.05, le=3600)
    """Seconds between two checks of backends_file's modification time."""
    dns_refresh_interval: float = Field(0.0, ge=0, le=86400)
    """Seconds between two resolutions of backend host names (0: off). On, a backend whose name resolves to several
    addresses becomes one instance per address (NAME, NAME-1, ...)."""
    kubernetes_service: str | None = Field(None, pattern=_K8S_SERVICE)
    """[NAMESPACE/]SERVICE whose EndpointSlices list the engine pods (ready ones become instances, terminating ones are
    drained; needs kubernetes-asyncio and RBAC: deploy/kubernetes/rbac.yaml)."""
    kubernetes_port: str | None = None
    """The engines' port in the EndpointSlices, by name or number (unset: the first port)."""
    inference_pool: str | None = Field(None, pattern=_K8S_POOL)
    """[NAMESPACE/]NAME of an InferencePool (inference.networking.k8s.io/v1) whose selector and targetPorts list the
    engine pods: ready pods become instances, the others are drained (needs kubernetes-asyncio and RBAC:
    deploy/kubernetes/inference-pool/)."""
    pod_deletion_cost: bool = True
    """With kubernetes_service or inference_pool: keep the annotation controller.kubernetes.io/pod-deletion-cost of the
    fleet's pods at what each instance's cache is worth (the cached prefill only it holds, weighted by demand), so a
    ReplicaSet scaling in removes the one worth least (needs RBAC to patch pods: deploy/kubernetes/rbac.yaml,
    deploy/kubernetes/inference-pool/rbac.yaml)."""
    pod_deletion_cost_interval: float = Field(15.0, ge=0.5, le=3600)
    """Seconds between two updates of the pods' deletion costs (a pod is patched only when its cost moved by over 5% or
    the pods' order changed)."""
    admin_token: SecretStr | None = None
    """Bearer token of the admin API (/admin/instances: list, add, drain, remove). Unset: the admin API does not
    exist."""
    observability_token: SecretStr | None = None
    """Token that /metrics, /dashboard and /dashboard/state require (Authorization: Bearer TOKEN, or HTTP Basic with
    it as the password, which a browser asks for): they show tenants, instances and traffic. Unset: open to anyone
    who reaches the port (/health, /ping and /livez always are)."""
    redis_url: SecretStr | None = None
    """Share prefix-index updates between router replicas through this Redis (redis://[:PASSWORD@]HOST:PORT[/DB],
    rediss://, unix://); unset: each replica keeps its own (needs the redis package: pip install 'warmroute[redis]')."""
    redis_channel: str = Field("warmroute:index", min_length=1, max_length=200)
    """Redis pub/sub channel of the shared index (one per fleet)."""
    dashboard: bool = True
    """Serve the live status page at /dashboard (and its JSON at /dashboard/state): instances, hit rates, hot prefixes,
    decisions; never prompt text or addresses."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(8080, ge=0, le=65535)
    """Port to listen on (0: any free port)."""
    epp_port: int = Field(9002, ge=0, le=65535)
    """`warmroute epp` only: port of the Envoy ext_proc gRPC service (the endpoint picker) and of its gRPC health
    service, on `host`; `port` then serves /metrics, /health, /dashboard and the admin API (0: any free port)."""
    epp_fallbacks: int = Field(0, ge=0, le=8)
    """`warmroute epp` only: fallback endpoints after the chosen one in x-gateway-destination-endpoint (the least loaded
    others, in order), tried by the gateway when the chosen one fails. 0 for an ORIGINAL_DST cluster, which reads one
    address; Envoy's override_host load-balancing policy reads the list (deploy/envoy/)."""
    ext_proc_message_timeout: float | None = Field(None, ge=0.0, le=3600)
    """`warmroute epp` only: seconds the gateway waits for the picker's answer to one message (Envoy ext_proc's
    message_timeout). The picker refuses to start unless admission.timeout_s and hold_timeout end a second before it: past
    it the gateway answers 503 itself, or, failing open, sends the request on past admission. Unset: read from
    envoy_config, else not checked."""
    envoy_config: str | None = None
    """`warmroute epp` only: the gateway's Envoy configuration (YAML); its ext_proc filters' smallest message_timeout
    is checked as ext_proc_message_timeout is."""
    admission: Annotated[AdmissionConfig, NoDecode] = Field(default_factory=AdmissionConfig)
    """The admission queue's settings (StrategySettings'; here WARMROUTE_ADMISSION is read as written: a boolean,
    off, no, ..., or a JSON mapping)."""
    strategy: str = "cache_aware"
    """Routing strategy: a built-in one, or one defined under `strategies`."""
    strategies: dict[str, StrategyProfile] = Field(default_factory=dict)
    """Strategies of your own, by name (YAML, or JSON in the variable): each a mapping of `stages` (stage names in
    pipeline order), `base` (a built-in strategy whose stages are the default) and `settings` (strategy settings it
    uses instead of the configured ones); `strategy` then names one. See docs/architecture.md, Defining a
    strategy."""
    trust_client_headers: bool = False
    """Honour what a request says about who sent it and how urgent it is: tenant_header, priority_header and the body's
    `user` field (tenant_from). Only for a hop that sets them itself after authenticating the client (a gateway that
    strips the client's own): any client can send them. Off: the tenant comes from the API key alone and the priority
    from the settings (docs/deployment.md, "Who may claim what")."""
    priority_header: str = Field("x-priority", pattern=r"^[A-Za-z0-9-]{1,64}$")
    """Request header carrying a request's priority, with trust_client_headers: a priority class's name or an integer
    (-1000..1000, higher first; mapped to the nearest class), never above its tenant's maximum."""
    priority_classes: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict, max_length=16)
    """The priorities requests may have, NAME=N,... or N,N,... (at most 16; -1000..1000, higher first), as the Gateway
    API Inference Extension's InferenceObjective declares them: a request's priority maps to the nearest, and metrics
    are labelled by its name. Unset: 0 and the integers of tenant_priorities, tenant_max_priorities and
    model_priorities."""
    tenant_header: str = Field("x-tenant", pattern=r"^[A-Za-z0-9-]{1,64}$")
    """Request header naming the tenant, with trust_client_headers (see tenant_from)."""
    tenant_from: Annotated[list[Literal["header", "api_key", "user"]], NoDecode] = Field(["header", "api_key"],
                                                                                          max_length=3)
    """Where a request's tenant comes from, first found wins: header (tenant_header) and user (the body's `user` field),
    both only with trust_client_headers; api_key (the bearer token: its tenant in api_keys, else a salted hash of it).
    Comma-separated. A request with none is the tenant `anonymous`. Tenants waiting at one priority share capacity by
    their weights."""
    api_keys: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    """Tenant per API key, SHA256=TENANT,... (the hex SHA-256 of the bearer token: `printf %s KEY | sha256sum`; never
    the key itself). Set, a key not listed is the tenant `anonymous`; unset, each key is a tenant of its own, named by
    a salted hash of it (api_key_salt)."""
    api_key_salt: SecretStr | None = None
    """Salt of the tenant names made from API keys not in api_keys (`key-` and 12 hex digits of HMAC-SHA256), so that
    /metrics and /dashboard cannot be matched against known keys. Unset: random at each start (names then differ
    between replicas and restarts: set the same salt on every replica to keep them)."""
    tenant_priorities: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    """Default priority per tenant, NAME=N,... (mapped to the nearest priority class)."""
    tenant_max_priorities: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    """Highest priority a tenant may claim (with trust_client_headers, in priority_header), NAME=N,...; a tenant not
    listed may claim no more than its default priority."""
    model_priorities: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    """Priority per model, NAME=N,... (below tenant_priorities)."""
    block_bytes: int = Field(64, ge=16, le=4096)
    """Block size of the prefix index in bytes (multiple of 8; 64 bytes is about 16 tokens)."""
    index_memory_bytes: Annotated[int, Field(ge=MiB, le=64 * GiB)] = 256 * MiB
    """Memory cap of the prefix index (accepts 256MiB, 1GiB, ...). The compiled index takes at most 144 bytes a block:
    256 MiB hold about 1.86 million blocks, some 30 million tokens of distinct prompts across the fleet (the Python
    fallback: 400 bytes a block)."""
    engine_capacity: int | None = Field(None, ge=1, le=1_000_000)
    """Requests an engine runs at once before it queues them (vLLM's max_num_seqs, or less where its KV cache fills
    first); per backend in YAML. A request whose chosen engine is that full waits in the router's queue (admission)
    rather than in the engine's. Unset: learned from each engine's /metrics (once it reports requests waiting on two
    scrapes in a row while running the most it was seen running lately, at least 32: fewer running with a queue is
    prefill, not a full batch; state it for an engine batching fewer), and until then the router never holds
    requests back for it. Not the concurrency_threshold, which only moves requests to another instance with room."""
    kv_capacity_tokens: int = Field(1_000_000, ge=256, le=10**10)
    """Default KV-cache capacity of an instance in tokens (per backend in YAML). If not set, the engine's own figure
    from its /metrics replaces the default once scraped."""
    engine_feedback: bool = True
    """Correct the prefix index from the cached prompt tokens engines report in their responses
    (usage.prompt_tokens_details.cached_tokens, llama.cpp's timings.cache_n)."""
    engine_metrics: bool = True
    """Scrape each instance's /metrics (vLLM and SGLang names) for the requests it has waiting and running, its KV-cache
    usage, and its KV capacity if not configured."""
    engine_metrics_interval: float = Field(1.0, ge=0.05, le=3600)
    """Seconds between two scrapes of an instance's /metrics."""
    health_interval: float = Field(2.0, ge=0.05, le=3600)
    """Seconds between active health checks."""
    models_interval: float = Field(30.0, ge=0, le=86400)
    """Seconds between two reads of each instance's /v1/models: a request naming a model goes only to the instances that
    list it (a fleet of mixed models or LoRA adapters behind one router); a model none lists goes to any. 0: never read
    (every instance may serve every model). A backend's `models` in the YAML file fixes its list."""
    health_timeout: float = Field(1.0, ge=0.05, le=60)
    """Seconds a health check (or a /v1/models query, or a /metrics scrape) may take."""
    connect_timeout: float = Field(2.0, ge=0.05, le=60)
    """Seconds to open an upstream connection."""
    first_byte_timeout: float = Field(120.0, ge=0.1, le=3600)
    """Seconds from sending a request to the upstream's first body byte."""
    retry: Literal["off", "connect", "no_answer"] = "no_answer"
    """When a request goes to a second instance (once at most, never the same one twice): connect: only when no
    connection could be opened (nothing was sent); no_answer: also when the instance took it but sent nothing back
    (first_byte_timeout, or it dropped the connection), after closing that connection so the engine stops computing it;
    off: never."""
    idle_timeout: float = Field(60.0, ge=0.1, le=3600)
    """Seconds allowed between two chunks of an upstream response."""
    client_header_timeout: float = Field(75.0, ge=0.1, le=3600)
    """Seconds a client connection may take to send a request's headers, or stay idle between requests, before it is
    closed (a client that trickles its headers byte by byte is cut off; its body is bounded by idle_timeout)."""
    tls_ca_file: str | None = None
    """PEM file of the certificate authorities trusted for https:// instances, instead of the system's (an internal
    CA)."""
    tls_cert_file: str | None = None
    """PEM client certificate the router presents to https:// instances (mutual TLS); with tls_key_file."""
    tls_key_file: str | None = None
    """PEM private key of tls_cert_file."""
    tls_verify: bool = True
    """Check https:// instances' certificates and host names (turn off only for testing)."""
    failures_before_ejection: int = Field(3, ge=1, le=100)
    """Consecutive 5xx responses, timeouts (connect, first byte, health check) or failed health checks that eject an
    instance (a refused connection ejects at once); never the last instance that could take its requests."""
    max_body_bytes: Annotated[int, Field(ge=KiB, le=GiB)] = 32 * MiB
    """Largest request body accepted (accepts 32MiB, ...); larger gets 413."""
    decision_headers: bool = True
    """Add x-warmroute-instance, x-warmroute-reason and x-warmroute-predicted-hit (the share of the prompt predicted
    cached there) to every proxied response."""
    access_log: bool = False
    """One JSON line per request on stdout: time, client address, method, path, status, duration, bytes, and for proxied
    requests the instance, the routing reason, the predicted cached share of the prompt and the time to the instance's
    first byte. Never prompt text, query strings or headers."""
    workers: int = Field(1, ge=1, le=64)
    """Worker processes sharing the listening socket; they share index updates (local sockets, or Redis with redis_url)
    and one /metrics."""
    shutdown_timeout: float = Field(30.0, ge=0, le=3600)
    """Seconds in-flight requests may take to finish after SIGTERM/SIGINT."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log verbosity."""
    kv_events: bool = False
    """Precise mode: index what each engine reports storing and evicting (vLLM's KV-cache events over ZMQ,
    `--kv-events-config`), matched against the request's own tokens (`tokenizer`); cache_aware uses it for every
    instance whose event stream is in step, the approximate model for the others. Needs strategy cache_aware,
    `tokenizer`, and pyzmq (pip install 'warmroute[events]')."""
    tokenizer: str | None = None
    """Model directory (tokenizer.json, tokenizer_config.json, the chat template) or tokenizer.json path of the model
    the engines serve: precise mode tokenizes each request as the engine will."""
    chat_template: str | None = None
    """Precise mode: the chat template the engines were given with vLLM's `--chat-template` (a file, or the template
    itself); unset: the model directory's own (chat_template.jinja, chat_template.json, then tokenizer_config.json)."""
    kv_events_discover: bool = True
    """Ask each instance whose backend entry gives no kv_events_endpoint where it publishes (vLLM's GET
    /kv_event_sources: its endpoints, ports chosen at start-up included), asking again until it answers; kv_events_port
    and kv_events_replay_port are used where it has no such endpoint."""
    kv_events_port: int = Field(5557, ge=0, le=65535)
    """Port of an instance's KV-event publisher at its URL's host, unless its backend entry gives kv_events_endpoint or
    the instance says (kv_events_discover); 0: only those."""
    kv_events_replay_port: int = Field(5558, ge=0, le=65535)
    """Port of an instance's KV-event replay socket at its URL's host, unless its backend entry gives
    kv_events_replay_endpoint (0: none). Without replay a lost batch leaves the instance to the approximate model until
    its engine clears its cache or restarts."""
    kv_events_topic: str = Field("", max_length=200)
    """Topic of the KV-event messages to subscribe to (empty: all)."""
    kv_speculative_ttl: float = Field(2.0, ge=0.0, le=600)
    """Seconds the exact index counts a request's blocks as held at its chosen instance before the engine's event for
    them has arrived."""

    @field_validator("backends", mode="before")
    @classmethod
    def _parse_backends(cls, v: Any) -> Any:
        return parse_backends(v)

    @field_validator("tenant_from", mode="before")
    @classmethod
    def _parse_list(cls, v: Any) -> Any:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("tenant_priorities", "tenant_max_priorities", "model_priorities", "api_keys",
                     mode="before")
    @classmethod
    def _parse_mapping(cls, v: Any) -> Any:
        return parse_mapping(v)

    @field_validator("priority_classes", mode="before")
    @classmethod
    def _parse_classes(cls, v: Any) -> Any:
        """NAME=N,... or plain integers (each named by itself), as a string or a YAML mapping or list."""
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, list):
            out: dict[str, Any] = {}
            for item in v:
                name, eq, value = str(item).partition("=")
                out[name.strip()] = value.strip() if eq else name.strip()
            return out
        return v

    @field_validator("tenant_priorities", "tenant_max_priorities", "model_priorities", "priority_classes")
    @classmethod
    def _check_priorities(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [k for k, p in v.items() if not -1000 <= p <= 1000]
        if bad:
            raise ValueError(f"priorities must be -1000..1000; {bad[0]!r} is not")
        return v

    @field_validator("priority_classes")
    @classmethod
    def _check_classes(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [k for k, p in v.items() if k != str(p) and (not _NAME.match(k) or re.fullmatch(r"-?\d+", k))]
        if bad:
            raise ValueError("priority class names must be 1-63 letters, digits, '.', '_' or '-' (an integer names "
                             f"only its own value); {bad[0]!r} is not")
        if len(set(v.values())) < len(v):
            raise ValueError("two priority classes have the same value")
        return v

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, v: dict[str, str]) -> dict[str, str]:
        out = {}
        for n, (digest, tenant) in enumerate(v.items()):
            digest = digest.strip().lower().removeprefix("sha256:")
            if not re.fullmatch(r"[0-9a-f]{64}", digest):  # what it is instead may be a key: not echoed
                raise ValueError(f"entry {n + 1}: keys must be the hex SHA-256 of an API key (64 hex digits: printf "
                                 "%s KEY | sha256sum), not the key itself")
            if not _NAME.match(tenant):
                raise ValueError(f"tenant names must be 1-63 letters, digits, '.', '_' or '-'; {tenant!r} is not")
            out[digest] = tenant
        return out

    @field_validator("index_memory_bytes", "max_body_bytes", mode="before")
    @classmethod
    def _parse_size(cls, v: Any) -> Any:
        return parse_size(v)

    @field_validator("redis_url")
    @classmethod
    def _check_redis(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and urlsplit(v.get_secret_value()).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return v

    @field_validator("block_bytes")
    @classmethod
    def _check_block(cls, v: int) -> int:
        if v % 8:
            raise ValueError("must be a multiple of 8")
        return v

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, v: list[Backend]) -> list[Backend]:
        names = [b.name for b in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"backend names must be unique; repeated: {', '.join(dupes)} (a name not given is "
                             "the URL's host, port and path: the same URL twice, or give each NAME=URL)")
        return v

    @field_validator("strategies")
    @classmethod
    def _check_strategies(cls, v: dict[str, StrategyProfile]) -> dict[str, StrategyProfile]:
        return check_profiles(v)

    @model_validator(mode="after")
    def _known_strategy(self) -> RouterSettings:
        if self.strategy not in STRATEGIES and self.strategy not in self.strategies:
            raise ValueError(f"invalid setting strategy = {self.strategy!r} ({flag_of('strategy')}, "
                             f"{env_of('strategy')}): must be one of {', '.join(strategy_names(self.strategies))}")
        return self

    def strategy_profile(self) -> StrategyProfile | None:
        """The chosen strategy's profile when the config defines it (None: a built-in)."""
        return self.strategies.get(self.strategy) if self.strategy not in STRATEGIES else None

    @model_validator(mode="after")
    def _tls_files(self) -> RouterSettings:
        """The certificate files load, so that a typo stops start-up instead of failing every https request."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(f"invalid setting tls_cert_file ({flag_of('tls_cert_file')}): tls_cert_file and "
                             f"tls_key_file ({flag_of('tls_key_file')}) go together")
        for name in ("tls_ca_file", "tls_cert_file"):
            if getattr(self, name) is None:
                continue  # nothing to load (a default context would read the system's CAs for nothing)
            try:
                upstream_tls(self, only=name)
            except (OSError, ssl.SSLError) as exc:
                why = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
                raise ValueError(f"invalid setting {name} ({flag_of(name)}): cannot load it: {why}") from None
        return self

    @model_validator(mode="after")
    def _claims_need_trust(self) -> RouterSettings:
        """A tenant source any client can write, asked for explicitly, needs the operator to say who writes it."""
        claimed = [s for s in self.tenant_from if s in ("header", "user")]
        if "tenant_from" in self.model_fields_set and claimed and not self.trust_client_headers:
            raise ValueError(f"invalid setting tenant_from ({flag_of('tenant_from')}): {claimed[0]} is whatever the "
                             f"client sends; set trust_client_headers ({flag_of('trust_client_headers')}) if a gateway "
                             "in front sets it after authenticating the client, or use api_key")
        return self

    @model_validator(mode="after")
    def _precise_mode(self) -> RouterSettings:
        """kv_events needs what it reads with: a failure here is one line at start-up, not an error per request."""
        if not self.kv_events:
            return self
        problem = None
        profile = self.strategy_profile()
        if self.strategy != "cache_aware" and (profile is None or "prefix_match" not in profile.pipeline()):
            problem = f"needs strategy cache_aware, or one with stage prefix_match (strategy is {self.strategy})"
        elif self.tokenizer is None:
            problem = f"needs a tokenizer ({flag_of('tokenizer')} MODEL_DIR: the model the engines serve)"
        else:
            problem = _events_missing() or _tokenizer_problem(self.tokenizer, self.chat_template)
        if problem:
            raise ValueError(f"invalid setting kv_events ({flag_of('kv_events')}): {problem}")
        return self

    @model_validator(mode="after")
    def _optional_packages(self) -> RouterSettings:
        """A setting that needs an optional package fails here, before the port is bound, naming the extra."""
        for name, module, extra in (("redis_url", "redis", "redis"),
                                    ("kubernetes_service", "kubernetes_asyncio", "kubernetes")):
            if getattr(self, name) is not None and importlib.util.find_spec(module) is None:
                raise ValueError(f"invalid setting {name} ({flag_of(name)}): it needs the {module} package: "
                                 f"pip install 'warmroute[{extra}]'")
        return self

    @model_validator(mode="after")
    def _some_backend_source(self) -> RouterSettings:
        if (not self.backends and not self.backends_file and self.admin_token is None and not self.kubernetes_service
                and not self.inference_pool):
            raise ValueError(f"invalid setting backends ({flag_of('backends')}, {env_of('backends')}): at least one "
                             "backend is required (--backend URL or NAME=URL), or a source of them (--backends-file, "
                             "--kubernetes-service, --inference-pool, or --admin-token to add them through the admin API)")
        return self

    def engine_capacity_of(self, backend: Backend) -> int | None:
        """The requests the operator says this backend's engine runs at once (its own figure, else the fleet's)."""
        return backend.engine_capacity if backend.engine_capacity is not None else self.engine_capacity

    def capacity_configured(self, backend: Backend) -> bool:
        """Whether the user gave this backend's KV capacity (else the engine's own figure is used once known)."""
        return backend.kv_capacity_tokens is not None or "kv_capacity_tokens" in self.model_fields_set


def _events_missing() -> str | None:
    if importlib.util.find_spec("zmq") is None:
        return "it needs the pyzmq package: pip install 'warmroute[events]'"
    return None


def _tokenizer_problem(path: str, chat_template: str | None) -> str | None:
    from warmroute.router.prompt_tokens import PromptTokenizer, TokenizerError

    try:
        PromptTokenizer(path, chat_template=chat_template)
    except TokenizerError as exc:
        return str(exc)
    return None


# -- a setting's names outside the model (its errors name them too) ------------------------------------------
def flag_of(name: str) -> str:
    return "--backend" if name == "backends" else "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


def upstream_tls(settings: RouterSettings, only: str | None = None) -> ssl.SSLContext | None:
    """The TLS context for https:// instances (proxied requests and the control plane alike); None: the
    clients' defaults (the system's CAs, verification on). `only`: load just that file (to name a bad one)."""
    s = settings
    if s.tls_ca_file is None and s.tls_cert_file is None and s.tls_verify and only is None:
        return None
    ctx = ssl.create_default_context(cafile=s.tls_ca_file if only in (None, "tls_ca_file") else None)
    if s.tls_cert_file is not None and only in (None, "tls_cert_file"):
        ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file)
    if not s.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
