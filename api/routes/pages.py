"""GET /jobs/{id}: a human page with the job's state, failure set, event history and a Gantt chart.

Browsers cannot set an Authorization header from the address bar, so this page also takes the token
as `?token=` (it then appears in access logs: use it on trusted networks only).

The page keeps itself current: its script long-polls GET /v1/jobs/{id}/schedule (without `worker`,
so never a heartbeat) with the token of its own address, and when a newer version is published it
fetches the page again and swaps the live part (state, Gantt chart, events) in place.
"""

from __future__ import annotations

import datetime as dt
import json
from html import escape
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import ServiceDep, SettingsDep, authenticate
from api.gantt_svg import gantt_svg

router = APIRouter(tags=["pages"])
_bearer = HTTPBearer(auto_error=False)

_STYLE = (
    "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}"
    ".bad{color:#b00;font-weight:bold}.ok{color:#070;font-weight:bold}#live-status{color:#666;font-size:12px}"
)

# Long-polls the schedule with the page's own token; on a new version, re-fetches this page and
# swaps #live. 304 (no change within `wait`) polls again at once; errors back off 5 s.
_SCRIPT = """
(() => {
  const live = document.getElementById("live");
  const status = document.getElementById("live-status");
  const token = new URLSearchParams(location.search).get("token");
  const headers = token ? {Authorization: "Bearer " + token} : {};
  const poll = new URL("../v1/jobs/" + encodeURIComponent(live.dataset.job) + "/schedule", location.href);
  const sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  async function run() {
    for (;;) {
      poll.search = "after_version=" + live.dataset.version + "&wait=25";
      try {
        const r = await fetch(poll, {headers, cache: "no-store"});
        if (r.status === 200) {
          await r.arrayBuffer();
          const page = await fetch(location.href, {headers, cache: "no-store"});
          if (!page.ok) throw new Error("HTTP " + page.status);
          const doc = new DOMParser().parseFromString(await page.text(), "text/html");
          const fresh = doc.getElementById("live");
          live.replaceChildren(...fresh.childNodes);
          live.dataset.version = fresh.dataset.version;
          status.textContent = "live: version " + fresh.dataset.version + " shown since "
            + new Date().toLocaleTimeString();
        } else if (r.status !== 304) {
          throw new Error("HTTP " + r.status);
        }
      } catch (err) {
        status.textContent = "live updates paused (" + err.message + "); retrying";
        await sleep(5000);
      }
    }
  }
  run();
})();
"""


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(
    job_id: str,
    service: ServiceDep,
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    token: Annotated[str | None, Query(description="Token, for browsers")] = None,
) -> HTMLResponse:
    """State, failure set, events and the current schedule as an inline SVG Gantt chart."""
    principal = authenticate(creds.credentials if creds else token, settings, service)
    if principal.role == "worker" and principal.job_id != job_id:
        raise HTTPException(403, "this worker token belongs to another job")
    rt = service.get(job_id)
    rec, view = rt.record, rt.view
    state_cls = "ok" if rec.state in ("running", "finished") else "bad"
    rows = [
        ("job", escape(rec.name)),
        ("state", f'<span class="{state_cls}">{escape(rec.state)}</span>'),
        ("failed workers", escape(json.dumps([list(w) for w in rt.scenario.failed])) or "none"),
        ("slow workers", escape(json.dumps([s.model_dump(mode="json") for s in rt.scenario.slow]))),
        ("done workers", escape(json.dumps([list(w) for w in sorted(rt.done)]))),
        ("version", str(rec.version)),
        ("made by", escape(view.source) if view else "-"),
        ("iteration time (ms)", f"{view.schedule['iteration_time_ms']:.3f}" if view else "-"),
        ("precomputed plans", f"{rec.precompute_done} / {rec.precompute_total}"),
    ]
    if rec.unrecoverable_stages:
        lost = f'<span class="bad">{rec.unrecoverable_stages}: restore from checkpoint</span>'
        rows.append(("lost stages", lost))
    events = service.store.list_events(job_id, limit=50)
    event_rows = "".join(
        f"<tr><td>{_when(e.created_at)}</td><td>{escape(e.event_id)}</td>"
        f"<td>{escape(json.loads(e.body_json)['kind'])}</td>"
        f"<td>{escape(json.dumps(json.loads(e.body_json)['workers']))}</td><td>{e.status_code}</td>"
        f"<td>{json.loads(e.result_json).get('version')}</td></tr>"
        for e in events
    )
    info = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    chart = gantt_svg(view.schedule) if view else "<p>no schedule yet</p>"
    html = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>recycle: {escape(rec.name)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>Job {escape(rec.name)} <small>({rec.id})</small></h1>"
        f"<p id='live-status'>live: updates when a new version is published</p>"
        f"<div id='live' data-job='{escape(rec.id)}' data-version='{rec.version}'>"
        f"<table>{info}</table><h2>Schedule, version {rec.version}</h2>{chart}"
        f"<h2>Events</h2><table><tr><th>time</th><th>event_id</th><th>kind</th><th>workers</th>"
        f"<th>status</th><th>version</th></tr>{event_rows or '<tr><td colspan=6>none</td></tr>'}</table>"
        f"</div><script>{_SCRIPT}</script></body></html>"
    )
    return HTMLResponse(html)
