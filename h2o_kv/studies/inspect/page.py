"""The inspect page: one self-contained HTML file (inline CSS, JS and PNG pictures; nothing fetched) of an `Inspection`.

- a table of the policies: budget, kept tokens per (layer, KV head), the kept bytes against a Full cache's, the answer;
- per policy, a layers x positions picture of the kept fraction (click it to scroll the text there);
- the prompt's text once per policy, side by side, each token shaded by the share of (layer, KV head) rows that keep
  it (`data-k` on its span: the fraction `KeptMap.fraction` reports, 3 decimals); hovering a token shows its
  position, its kept count per layer and its score, and outlines it in every column.

`#p=N` at the end of the page's address scrolls the columns to position N, `#q=TEXT` to where the prompt says TEXT
(the find box's search). The spans are joined strings, so a
32k-token prompt writes in well under a second and weighs about 1 MB per policy.
"""

from __future__ import annotations

import base64
import html
import json

import torch

from h2o_kv.studies.inspect.picture import colour, columns, data_url, picture
from h2o_kv.studies.inspect.run import Inspection, Run

SHADES = 10  # the text's shading classes k0..k10 (the fraction to the nearest tenth)

CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:12px 18px;color:#1b1b1b;background:#fff}
h1{font-size:18px;margin:0}h2{font-size:14px;margin:10px 0 4px}h3{font-size:12.5px;margin:0 0 2px;font-weight:600}
.meta{color:#555;margin:2px 0 6px}.q{background:#f3f3f3;padding:4px 8px;border-radius:4px;white-space:pre-wrap}
table{border-collapse:collapse;margin:4px 0 6px}td,th{border-bottom:1px solid #ddd;padding:3px 9px;text-align:left;
vertical-align:top}th{font-weight:600;background:#fafafa}td.n{text-align:right;font-variant-numeric:tabular-nums}
.answer{font-family:ui-monospace,monospace;white-space:pre-wrap;max-width:440px}
.pics,.cols{display:grid;gap:8px 16px}
.pic img{width:100%;image-rendering:pixelated;display:block;border:1px solid #ccc;cursor:crosshair}
.axis{display:flex;justify-content:space-between;color:#666;font-size:11px}
.bar{display:flex;align-items:center;gap:6px;color:#555;font-size:12px;margin:2px 0 4px;flex-wrap:wrap}
.bar i{display:inline-block;width:140px;height:10px;border:1px solid #ccc}.bar input{width:260px}
.text{position:relative;height:58vh;overflow:auto;border:1px solid #ccc;padding:4px 8px;white-space:pre-wrap;
font:12.5px/1.5 ui-monospace,monospace;word-break:break-word}
.text span.hl{box-shadow:inset 0 -3px 0 #d7301f}
#tip{position:fixed;display:none;pointer-events:none;background:#fff;border:1px solid #999;padding:6px 8px;
font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.2);z-index:9;max-width:360px}
#tip canvas{display:block;margin-top:4px}
"""

JS = """
const runs=JSON.parse(document.getElementById('data').textContent);
const bytes=s=>Uint8Array.from(atob(s),c=>c.charCodeAt(0));
for(const r of runs){r.counts=bytes(r.counts);r.score=new Float32Array(bytes(r.score).buffer);}
const boxes=[...document.querySelectorAll('.text')],spans=boxes.map(b=>b.children),first=spans[0];
spans.forEach(list=>{for(let i=0;i<list.length;i++)list[i]._i=i;});
const starts=[];let whole='';for(const s of first){starts.push(whole.length);whole+=s.textContent;}
const low=whole.toLowerCase(),tip=document.getElementById('tip');let lit=[],syncing=false,found=-1;
function light(a,b){for(const list of spans){for(const i of lit)list[i]&&list[i].classList.remove('hl');
 for(let i=a;i<=b;i++)list[i]&&list[i].classList.add('hl');}lit=[];for(let i=a;i<=b;i++)lit.push(i);}
function show(j,i,ev){const r=runs[j],L=r.heads.length,c=r.counts.subarray(i*L,i*L+L);
 let n=0;for(const v of c)n+=v;
 tip.innerHTML='<b>'+r.label+'</b> position '+i+' <code></code><br>kept by '+n+' of '+r.rows+' rows ('+
  (100*n/r.rows).toFixed(1)+' %), score '+(n?r.score[i].toPrecision(3):'-')+
  '<br>kept per layer (0 to '+(L-1)+'): '+Array.from(c).join(' ')+'<canvas width='+(3*L)+' height=30></canvas>';
 tip.querySelector('code').textContent=JSON.stringify(spans[j][i].textContent);
 const g=tip.querySelector('canvas').getContext('2d');g.fillStyle='#eee';g.fillRect(0,0,3*L,30);g.fillStyle='#238b45';
 for(let l=0;l<L;l++){const h=30*c[l]/Math.max(1,r.heads[l]);g.fillRect(3*l,30-h,2,h);}
 tip.style.display='block';place(ev);}
function place(ev){const x=Math.min(ev.clientX+14,innerWidth-tip.offsetWidth-8);
 const y=ev.clientY+16+tip.offsetHeight>innerHeight?ev.clientY-tip.offsetHeight-10:ev.clientY+16;
 tip.style.left=x+'px';tip.style.top=y+'px';}
boxes.forEach((box,j)=>{
 box.addEventListener('mouseover',ev=>{const s=ev.target;if(s._i===undefined)return;light(s._i,s._i);show(j,s._i,ev);});
 box.addEventListener('mousemove',ev=>{if(tip.style.display==='block')place(ev);});
 box.addEventListener('mouseleave',()=>{tip.style.display='none';});
 box.addEventListener('scroll',()=>{if(syncing)return;syncing=true;
  for(const other of boxes)if(other!==box)other.scrollTop=box.scrollTop;syncing=false;});});
function go(a,b){a=Math.max(0,Math.min(a,first.length-1));light(a,b===undefined?a:b);
 for(const box of boxes){const s=box.children[a];if(s)box.scrollTop=s.offsetTop-box.clientHeight/3;}}
function find(text,from){const q=text.toLowerCase();if(!q)return;let at=low.indexOf(q,from);
 if(at<0)at=low.indexOf(q);const out=document.getElementById('found');
 if(at<0){out.textContent='not in the prompt';return;}found=at;let a=0,b;
 while(a+1<starts.length&&starts[a+1]<=at)a++;b=a;while(b+1<starts.length&&starts[b+1]<at+q.length)b++;
 out.textContent='positions '+a+' to '+b;go(a,b);}
const box=document.getElementById('find');
box.addEventListener('keydown',ev=>{if(ev.key==='Enter')find(box.value,found+1);});
document.querySelectorAll('.pic img').forEach(img=>img.addEventListener('click',ev=>{
 const b=img.getBoundingClientRect();go(Math.floor((ev.clientX-b.left)/b.width*(+img.dataset.positions)));}));
const hash=new URLSearchParams(location.hash.slice(1));
if(hash.get('q')){box.value=hash.get('q');find(hash.get('q'),0);}else if(hash.get('p'))go(+hash.get('p'));
"""


def render(inspection: Inspection) -> str:
    """The page of `inspection`, as one HTML string."""
    runs = inspection.runs
    prompt = inspection.prompt_tokens
    title = f"h2o-kv inspect: {inspection.model}, {prompt} prompt tokens"
    question = "" if inspection.question is None else f"<div class=q><b>Question:</b> {_e(inspection.question)}</div>"
    grid = f"grid-template-columns:repeat({len(runs)},minmax(0,1fr))"
    pieces = {token: html.escape(token, quote=False) for token in set(inspection.tokens)}
    escaped = [pieces[token] for token in inspection.tokens]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>{_e(title)}</title><style>{CSS}{_shades()}</style></head><body>",
        f"<h1>What the cache kept</h1><div class=meta>{_e(inspection.model)} · {prompt} prompt tokens · "
        f"{len(runs)} {'policy' if len(runs) == 1 else 'policies'} · shading: the share of (layer, KV head) rows that "
        "still hold a token at the end</div>",
        question,
        _table(runs, prompt),
        '<h2>Kept fraction, layers x positions</h2><div class=bar>none <i style="background:linear-gradient(90deg,'
        f'{colour(0)},{colour(0.25)},{colour(0.5)},{colour(0.75)},{colour(1)})"></i> every KV head of the layer'
        " · click a picture to scroll the text there</div>",
        f'<div class=pics style="{grid}">{"".join(_picture(run, prompt) for run in runs)}</div>',
        "<h2>The prompt, shaded by the kept fraction</h2><div class=bar>find in the prompt <input id=find "
        'placeholder="a fact, then Enter"> <span id=found></span> · hover a token for its count per layer</div>',
        f'<div class=cols style="{grid}">',
        *(_column(run, escaped) for run in runs),
        "</div><div id=tip></div>",
        f'<script type="application/json" id=data>{_data(runs, prompt)}</script>',
        f"<script>{JS}</script></body></html>",
    ]
    return "".join(parts)


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _table(runs: list[Run], prompt: int) -> str:
    head = ("policy", "kept per (layer, KV head)", "kept of the prompt", "KV kept", "a Full cache's", "answer", "time")
    rows = []
    for run in runs:
        kept = run.kept.kept_per_row()[run.kept.heads > 0]
        shown = kept[:, : int(run.kept.heads.max())]
        low, high = int(shown.min()), int(shown.max())
        per_row = f"{low}" if low == high else f"{low} to {high}"
        share = float(run.kept.fraction()[:prompt].mean()) if prompt else 0.0
        answer = _e(run.answer) if run.new_tokens else "<i>(no tokens generated)</i>"
        cells = (
            f"<b>{_e(run.label)}</b><br><small>{_e(run.policy)}</small>",
            f"{per_row} of {run.kept.positions} seen",
            f"{share:.1%}",
            _mib(run.kept.kept_bytes),
            f"{run.kept.kept_bytes / max(run.full_bytes, 1):.0%} of {_mib(run.full_bytes)}",
            f"<div class=answer>{answer}</div>",
            f"{run.seconds:.1f} s",
        )
        classes = ("", "n", "n", "n", "n", "", "n")
        rows.append("<tr>" + "".join(f"<td class={c}>{v}</td>" if c else f"<td>{v}</td>" for c, v in
                                     zip(classes, cells)) + "</tr>")  # fmt: skip
    header = "".join(f"<th>{h}</th>" for h in head)
    return f"<table data-role=runs><tr>{header}</tr>{''.join(rows)}</table>"


def _picture(run: Run, prompt: int) -> str:
    layers = run.kept.layer_fraction()[:, :prompt]
    height = min(160, max(48, 4 * layers.shape[0]))
    per = columns(prompt)
    ticks = "".join(f"<span>{round(prompt * q / 4)}</span>" for q in range(5))
    return (
        f"<div class=pic><h3>{_e(run.label)} <small>(layer 0 at the top, {layers.shape[0]} layers; "
        f"{per} position{'s' if per > 1 else ''} a pixel)</small></h3>"
        f'<img alt="kept fraction of {_e(run.label)}, layers x positions" data-positions={prompt} '
        f'style="height:{height}px" src="{data_url(picture(layers))}"><div class=axis>{ticks}</div></div>'
    )


def _column(run: Run, escaped: list[str]) -> str:
    """A policy's copy of the prompt: one span per token (`escaped`: the tokens' text, HTML-escaped), with its kept
    fraction in `data-k` and its shade class. Spans are joined from a table of the 1001 possible openings."""
    thousandths = (run.kept.fraction()[: len(escaped)] * 1000).round().int().tolist()
    spans = "".join([OPENINGS[m] + text + "</span>" for m, text in zip(thousandths, escaped)])
    return (
        f"<div class=col><h3>{_e(run.label)}</h3>"
        f'<div class=text data-policy="{_e(run.label)}" data-rows={run.kept.rows}>{spans}</div></div>'
    )


OPENINGS = [f"<span class=k{round(m * SHADES / 1000)} data-k={m / 1000:.3f}>" for m in range(1001)]


def _shades() -> str:
    """The text's shading classes, in the picture's colours (white text on the darkest, grey where nothing kept)."""
    fills = "".join(f".text .k{k}{{background:{colour(k / SHADES)}}}" for k in range(1, SHADES + 1))
    return fills + ".text .k0{color:#8a8a8a}.text .k8,.text .k9,.text .k10{color:#fff}"


def _data(runs: list[Run], prompt: int) -> str:
    """Per policy, what hovering shows: the kept count of each (position, layer), position-major, and each position's
    mean score, as base64 of uint8 and float32 arrays."""
    data = []
    for run in runs:
        counts = run.kept.per_layer()[:, :prompt].t().clamp(max=255).to(torch.uint8).contiguous()
        score = run.kept.mean_score()[:prompt].float().contiguous()
        data.append({
            "label": run.label,
            "rows": run.kept.rows,
            "heads": run.kept.heads.tolist(),
            "counts": base64.b64encode(counts.numpy().tobytes()).decode("ascii"),
            "score": base64.b64encode(score.numpy().tobytes()).decode("ascii"),
        })  # fmt: skip
    return json.dumps(data).replace("</", "<\\/")
