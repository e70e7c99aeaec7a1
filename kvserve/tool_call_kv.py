"""KV kept while a tool runs, on the engine's side, applied after each step: a chat answer that asked
for a hold (request.tool_call.hold) gets a lease on its conversation's cached pages when it finishes
(its prompt and output, as the prefix index holds them: nothing is allocated between a step's free
and this call, so they are all still there); a follow-up request ends the holds of the calls whose
results it brings once its prompt is computed (its own references hold those pages then). The server
releases a hold at once when the answer was not a tool call (server/tool_holds.py)."""

from __future__ import annotations

from dataclasses import replace

from kvserve.cache.manager import KVCacheManager
from kvserve.request import Request, RequestStatus


def after_step(manager: KVCacheManager, request: Request) -> None:
    tool = request.tool_call
    if tool is None:
        return
    if tool.answers and request.num_computed_tokens >= request.num_prompt_tokens:
        for lease_id in tool.answers:
            manager.leases.use_hold(lease_id, request.tenant)
        request.tool_call = tool = replace(tool, answers=())
    ttl_s = tool.hold_s if tool.hold and tool.hold_s is not None else request.hold_ttl_s
    # (a length-cut answer is no tool call, but a stored response it ends is continued all the same)
    if (request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and ttl_s > 0
            and request.cache.held_lease_id is None and request.cache.hold_refused is None):
        hit = manager.lookup(request.token_ids, request.namespace)
        num_pages = hit.num_tokens // manager.page_size  # full pages only
        held = manager.leases.hold(request.namespace, list(hit.pages[:num_pages]),
                                   num_pages * manager.page_size, ttl_s, manager.clock(),
                                   request.tenant)
        if isinstance(held, str):
            request.cache.hold_refused = held
        else:
            request.cache.held_lease_id = held.lease_id
