"""Who may use the Serve app: API keys (from the arguments, the environment or a file), the Bearer check,
and closed unless opened: Serve listening beyond loopback needs API keys, or an explicit allow_open."""
import hmac
import ipaddress
import logging
from pathlib import Path

# under ray.serve, as pipeline.serve's: Serve's replica log handler takes these too
log = logging.getLogger("ray.serve.specee")

OPEN_HINT = ("set api_keys / SPECEE_API_KEYS / api_keys_file / SPECEE_API_KEYS_FILE, or pass allow_open=True to "
             "serve without keys")


def read_keys_file(path: str | Path) -> list[str]:
    """The API keys in a file, one a line; blank lines and lines starting with # are skipped. ValueError
    naming the file when it is missing, unreadable or holds no key."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"api_keys_file {str(path)!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"api_keys_file {str(path)!r} is not UTF-8 text") from None
    keys = [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]
    if not keys:
        raise ValueError(f"api_keys_file {str(path)!r} holds no key (one a line; blank lines and # comments "
                         f"are skipped)")
    return keys


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine only: localhost or a loopback address (127.0.0.0/8,
    ::1). Any other name counts as reachable from outside: it may resolve to any interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str | None, *, has_keys: bool, allow_open: bool) -> None:
    """Closed unless opened: ValueError when Serve listens on a host beyond loopback (`host`; None: HTTP
    off or not known yet) and no API keys are set, unless allow_open, which logs a warning instead."""
    if host is None or has_keys or is_loopback(host):
        return
    if not allow_open:
        raise ValueError(f"Serve listens on {host} and no api_keys are set: {OPEN_HINT}")
    log.warning("SERVING WITHOUT API KEYS on %s (allow_open=True): anyone who reaches this port can run the "
                "model and read /metrics, /healthz and /docs", host)


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies listen on (http_options.host), from its controller; None while no Serve
    runs in this process's Ray cluster (`serve run` calls the app builder before it starts one) or with
    HTTP off."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return None
    # Serve has no public getter for its HTTP options; its controller client (what serve.run and
    # `serve status` use) asks the controller for them, from a replica too
    client = serve.context._get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.http_config.host


def bearer_ok(authorization: str, keys: list[bytes]) -> bool:
    """Whether an Authorization header is `Bearer <one of keys>` (constant-time comparison)."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip().encode()
    return scheme.lower() == "bearer" and any(hmac.compare_digest(token, k) for k in keys)
