"""Reading a running server's ``/lucepy/status`` (for ``lucepy top``), with the standard library."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from lucepy.errors import AuthError, ServerUnreachable


def fetch_status(url: str, api_key: str | None = None, timeout: float = 2.0) -> dict:
    """The status JSON of the server at ``url`` (``http://HOST:PORT``)."""
    endpoint = url.rstrip("/") + "/lucepy/status"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(endpoint, headers=headers), timeout=timeout
        ) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise AuthError(f"{url} wants an API key; pass --api-key KEY") from None
        raise ServerUnreachable(
            f"{endpoint} answered HTTP {err.code}; is it a lucepy server?"
        ) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ServerUnreachable(
            f"cannot reach {url} ({reason}); is `lucepy serve` running?"
        ) from None
    except ValueError:
        raise ServerUnreachable(f"{endpoint} did not answer JSON; is it a lucepy server?") from None
