"""Schema of `python -m qie.studio`: the local page and job queue (its root and its own `studio` node)."""

import ipaddress
from dataclasses import dataclass, field

from qie.config.ranges import first, out_of_range

# Host names that reach this machine only.
LOOPBACK_NAMES = ("localhost",)


@dataclass
class StudioConfig:
    # The address the page is served on: this machine only by default; any other needs `token`.
    host: str = "127.0.0.1"
    # 0: any free port (the address printed names it).
    port: int = 8765
    # A secret every request must carry (the page's address gets it as ?token=...); required off this machine.
    token: str | None = None
    # Jobs run at a time (one per device is the safe choice).
    parallel: int = 1
    # The queue's database, the jobs' run folders and the images read from Hugging Face data sets.
    home: str = "${qie_home:}/studio"

    def problem(self) -> str | None:
        """The port and the job count out of range, or another host than this machine's without a token."""
        if problem := first(
            out_of_range("studio.port", self.port, 0, 65535), out_of_range("studio.parallel", self.parallel, 1)
        ):
            return problem
        if not self.token and not is_loopback(self.host):
            return (
                f"studio.host={self.host} serves the page beyond this machine: set studio.token=SECRET too "
                "(every request must then carry it), or keep studio.host=127.0.0.1"
            )
        return None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) reaches this machine only."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class StudioRoot:
    studio: StudioConfig = field(default_factory=StudioConfig)
