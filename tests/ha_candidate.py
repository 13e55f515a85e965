"""A controller candidate as its own process, for the election tests that freeze it.

``python -m tests.ha_candidate ENDPOINTS ADDRESS TTL``: campaigns, prints ``leader
TOKEN`` once elected, then every 0.1 s writes a journal entry through the fenced store
(as a leader that goes on programming would) and prints ``wrote`` or ``refused
<error>``; prints ``lost <reason>`` when the election says leadership is lost, and exits
after its first refused write once lost.
"""

from __future__ import annotations

import asyncio
import sys

from fabric_controller.election import Election
from fabric_controller.etcd_store import Etcd, EtcdStore
from fabric_controller.store import PendingRecord
from orchestrrl import errors
from orchestrrl.model import Phase


def say(text: str) -> None:
    print(text, flush=True)


async def main(endpoints: str, address: str, ttl_s: int) -> None:
    etcd = Etcd(endpoints.split(","), call_timeout_s=0.5, deadline_s=1.0)
    async with Election(etcd, address, ttl_s=ttl_s, on_lost=lambda r: say(f"lost {r}")) as e:
        fence = await e.campaign()
        say(f"leader {fence.token}")
        store = (await EtcdStore.open(etcd)).fenced(fence)
        while True:
            journal = PendingRecord(fence.token, Phase.TRAINING, frozenset(), frozenset(),
                                    frozenset(), f"by {address}", None, 0.0)  # fmt: skip
            try:
                await store.begin(journal)
                say("wrote")
            except errors.OrlError as exc:
                say(f"refused {type(exc).__name__}: {exc}")
                if e.lost.is_set():
                    break
            await asyncio.sleep(0.1)
    await etcd.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
