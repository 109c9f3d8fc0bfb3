"""API keys: the `--api-key` values plus an optional `--api-key-file`, re-read when it changes,
so an operator rotates keys without a restart (add the new key, move clients, drop the old one).

A token is checked against every key in constant time (SHA-256 digests of equal length,
compared with `hmac.compare_digest`, no early exit), so neither the timing nor the answer says
which key came close. Keys are never logged; messages name the file and line, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

from ..config import ServerConfig, check_api_key
from ..errors import ConfigError

logger = logging.getLogger(__name__)

RECHECK_S = 1.0         # the key file's mtime is looked at no more often than this


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str) -> list[str]:
    """The keys in `path`: one a line, blank lines and `#` comment lines ignored; ConfigError if
    it cannot be read or holds no key."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot be read ({type(exc).__name__}: "
                          f"{getattr(exc, 'strerror', None) or 'not UTF-8 text'})") from None
    keys = [check_api_key(s, f"--api-key-file {path} line {n}")
            for n, s in ((n, line.strip()) for n, line in enumerate(lines, 1)) if s and not s.startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key; write one key per line")
    return keys


class KeyRing:
    """The accepted keys. `match(token)` is the digest of the key it equals (the caller's
    identity for rate limiting), or None."""

    def __init__(self, config: ServerConfig, clock=time.monotonic):
        self.path = config.http.api_key_file
        self.clock = clock
        self._static = [_digest(k) for k in config.http.api_keys]
        self._from_file: list[bytes] = []
        self._stamp = None
        self._bad_stamp = False                     # the file's stamp when it last failed to read
        self._checked = 0.0
        if self.path:
            self._stamp = self._file_stamp()
            self._from_file = [_digest(k) for k in read_key_file(self.path)]    # ConfigError at start
            self._checked = clock()

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (any key configured)."""
        return bool(self._static) or self.path is not None

    def match(self, token: str) -> bytes | None:
        """The digest of the key `token` equals, or None; looks at every key whatever it finds."""
        self._maybe_reload()
        given, found = _digest(token), None
        for key in self._static + self._from_file:
            if hmac.compare_digest(given, key) and found is None:
                found = key
        return found

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _maybe_reload(self) -> None:
        """Re-read the key file if it changed; a file that turns unreadable or empty keeps the
        last good keys (an editor that truncates before it writes must not lock everyone out)."""
        if self.path is None or self.clock() - self._checked < RECHECK_S:
            return
        self._checked = self.clock()
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        try:
            keys = read_key_file(self.path)
        except ConfigError as exc:
            if stamp != self._bad_stamp:            # once per state of the file, not every second
                logger.warning("%s; keeping the %d keys read before", exc, len(self._from_file))
                self._bad_stamp = stamp
            return
        self._stamp, self._from_file = stamp, [_digest(k) for k in keys]
        logger.info("--api-key-file %s re-read: %d keys", self.path, len(keys))
