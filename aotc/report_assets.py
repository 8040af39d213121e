"""The report page's stylesheet and script (aotc/report.py), inline in every page.

The script: pan and zoom on each picture (wheel, drag, +/-/fit), fitting a picture when its module
block is opened, opening the module a box links to, and the search box (matches in the node lists
and pictures highlighted, listed as links; `?q=text` searches on load). No network, no storage.
"""

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 24px 24px; color: #222; }
header { position: sticky; top: 0; background: #fff; padding: 10px 0; z-index: 5;
  border-bottom: 1px solid #ddd; }
h1 { font-size: 22px; margin: 0 0 6px; } h2 { font-size: 18px; margin: 0 0 8px; }
section { border: 1px solid #ccc; border-radius: 6px; padding: 14px 18px; margin: 18px 0; }
section.failed { border-color: #c0392b; background: #fff6f5; }
table.facts td:first-child { color: #555; padding-right: 16px; vertical-align: top;
  white-space: nowrap; }
table.facts td { padding: 2px 0; }
.note { background: #fff4d6; border: 1px solid #e0b84c; padding: 8px 12px; border-radius: 4px; }
pre.error { background: #fdecea; border: 1px solid #e5a19b; padding: 8px; white-space: pre-wrap; }
.viewport { position: relative; overflow: hidden; height: 70vh; min-height: 160px;
  border: 1px solid #ddd; border-radius: 4px; background: #fcfcfc; cursor: grab; margin: 6px 0; }
.viewport svg { transform-origin: 0 0; position: absolute; left: 0; top: 0; }
.zoom { position: absolute; right: 6px; top: 6px; z-index: 2; }
.zoom button { width: 30px; height: 26px; margin-left: 2px; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 8px; border-radius: 4px;
  border: 1px solid #999; font-size: 12px; }
details.module { margin: 2px 0 2px 14px; }
details.module > summary { cursor: pointer; }
details.module > summary .count { color: #777; font-size: 12px; }
ul.nodes { list-style: none; padding-left: 14px; margin: 4px 0; font: 12px/1.4 monospace; }
ul.nodes li { white-space: pre; overflow-x: auto; }
ul.nodes li .where { color: #777; }
ul.nodes li.hit, g.node.hit > * { background: #ffe25c; outline: 2px solid #e0a800; }
g.node.hit polygon, g.node.hit path, g.node.hit ellipse { stroke: #e0a800; stroke-width: 4px; }
.side-backward, .side-both, .side-tangent { color: #8a4b08; }
ul.files { columns: 3; padding-left: 18px; margin: 4px 0; }
pre.code { max-height: 60vh; overflow: auto; background: #f7f7f7; padding: 8px; font-size: 12px; }
#search { width: 420px; font-size: 14px; padding: 3px 6px; }
#search-results { max-height: 30vh; overflow: auto; font-size: 13px; }
code { font-size: 12px; }
"""

SCRIPT = """
(function () {
  function reveal(el) {
    for (var p = el; p; p = p.parentElement) if (p.tagName === 'DETAILS') p.open = true;
  }
  function setup(vp) {
    var svg = vp.querySelector('svg');
    if (!svg || vp.dataset.ready) return;
    vp.dataset.ready = '1';
    var w = parseFloat(svg.getAttribute('width')) * 4 / 3, h = parseFloat(svg.getAttribute('height')) * 4 / 3;
    svg.style.width = w + 'px'; svg.style.height = h + 'px';
    var s = 1, x = 0, y = 0, drag = null;
    function apply() { svg.style.transform = 'translate(' + x + 'px,' + y + 'px) scale(' + s + ')'; }
    function fit() {
      var W = vp.clientWidth || 800, H = Math.max(240, 0.7 * window.innerHeight);
      s = Math.min(W / w, H / h, 1);
      vp.style.height = Math.max(160, Math.ceil(h * s) + 12) + 'px';
      x = (W - w * s) / 2; y = 6; apply();
    }
    function zoom(k, px, py) { x = px - (px - x) * k; y = py - (py - y) * k; s *= k; apply(); }
    vp.addEventListener('wheel', function (e) {
      e.preventDefault(); var r = vp.getBoundingClientRect();
      zoom(Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
    }, { passive: false });
    vp.addEventListener('mousedown', function (e) {
      if (e.target.closest('a') || e.target.closest('button')) return;
      drag = [e.clientX - x, e.clientY - y];
    });
    window.addEventListener('mousemove', function (e) {
      if (drag) { x = e.clientX - drag[0]; y = e.clientY - drag[1]; apply(); }
    });
    window.addEventListener('mouseup', function () { drag = null; });
    vp.querySelector('.zin').onclick = function () { zoom(1.25, vp.clientWidth / 2, vp.clientHeight / 2); };
    vp.querySelector('.zout').onclick = function () { zoom(0.8, vp.clientWidth / 2, vp.clientHeight / 2); };
    vp.querySelector('.zfit').onclick = fit;
    vp.centerOn = function (g) {
      var b = g.getBBox(), ctm = g.getCTM(), root = svg.getCTM();
      var cx = (b.x + b.width / 2), cy = (b.y + b.height / 2);
      if (ctm && root) { var m = root.inverse().multiply(ctm); cx = m.a * cx + m.c * cy + m.e; cy = m.b * cx + m.d * cy + m.f; }
      var vb = svg.viewBox.baseVal, kx = w / (vb.width || w), ky = h / (vb.height || h);
      s = Math.max(s, 1); x = vp.clientWidth / 2 - (cx - vb.x) * kx * s; y = vp.clientHeight / 2 - (cy - vb.y) * ky * s; apply();
    };
    fit();
  }
  function setupVisible(root) {
    (root || document).querySelectorAll('.viewport').forEach(function (vp) {
      if (vp.offsetParent !== null) setup(vp);
    });
  }
  document.querySelectorAll('details').forEach(function (d) {
    d.addEventListener('toggle', function () { if (d.open) setupVisible(d); });
  });
  function openHash() {
    var id = decodeURIComponent(location.hash.slice(1)); var el = id && document.getElementById(id);
    if (el) { reveal(el); setupVisible(el); el.scrollIntoView(); }
  }
  window.addEventListener('hashchange', openHash);
  var box = document.getElementById('search'), out = document.getElementById('search-results');
  var items = Array.prototype.slice.call(document.querySelectorAll('ul.nodes li[data-k]'));
  var svgNodes = Array.prototype.slice.call(document.querySelectorAll('g.node[id]'));
  function search() {
    var q = box.value.trim().toLowerCase();
    document.querySelectorAll('.hit').forEach(function (e) { e.classList.remove('hit'); });
    out.innerHTML = '';
    out.dataset.count = '0';
    if (!q) return;
    var hits = items.filter(function (li) { return li.dataset.k.indexOf(q) >= 0; });
    var keys = {};
    hits.forEach(function (li) { li.classList.add('hit'); keys[li.dataset.g + '::' + li.dataset.n] = 1; });
    svgNodes.forEach(function (g) {
      var parts = g.id.split('::');
      if (parts.length >= 3 && keys[parts[0] + '::' + parts.slice(2).join('::')]) g.classList.add('hit');
    });
    out.dataset.count = String(hits.length);
    var head = document.createElement('p');
    head.textContent = hits.length + ' node(s) match "' + q + '"' + (hits.length > 200 ? ' (first 200 listed)' : '');
    out.appendChild(head);
    var ol = document.createElement('ol');
    hits.slice(0, 200).forEach(function (li) {
      var a = document.createElement('a'); a.href = '#' + li.id;
      a.textContent = li.dataset.g + ' / ' + (li.dataset.m || 'top level') + ' / ' + li.dataset.n;
      a.onclick = function (e) {
        e.preventDefault(); reveal(li); setupVisible(li.closest('section'));
        li.scrollIntoView({ block: 'center' });
        var det = li.closest('details.module') || li.closest('section');
        var g = det && det.querySelector('g.node.hit');
        var vp = g && g.closest('.viewport'); if (vp && vp.centerOn) vp.centerOn(g);
      };
      var item = document.createElement('li'); item.appendChild(a); ol.appendChild(item);
    });
    out.appendChild(ol);
    hits.slice(0, 50).forEach(function (li) { reveal(li); });
    setupVisible();
  }
  var timer = null;
  box.addEventListener('input', function () { clearTimeout(timer); timer = setTimeout(search, 200); });
  var q = new URLSearchParams(location.search).get('q');
  if (q) { box.value = q; search(); }
  setupVisible();
  openHash();
})();
"""
