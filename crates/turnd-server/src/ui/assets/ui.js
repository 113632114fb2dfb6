// The operator page's only script (served from /ui/assets/; the
// Content-Security-Policy allows no inline script). It keeps relative times
// ticking, replaces a screen's live region with the fragments its feed sends,
// and appends a session's new events to its events table. Everything it puts
// in the page from the data is text (textContent) or HTML the daemon rendered
// and escaped.
(function () {
  'use strict';

  // The daemon's clock minus the browser's, so that times tick against the
  // daemon's.
  var skew = 0;

  function dur(ms) {
    if (ms < 1000) { return ms + 'ms'; }
    if (ms < 60000) { return (ms / 1000).toFixed(1) + 's'; }
    var pad = function (n) { return (n < 10 ? '0' : '') + n; };
    if (ms < 3600000) {
      return Math.floor(ms / 60000) + 'm' + pad(Math.floor(ms / 1000) % 60) + 's';
    }
    return Math.floor(ms / 3600000) + 'h' + pad(Math.floor(ms / 60000) % 60) + 'm';
  }

  function tick() {
    var now = Date.now() + skew;
    var els = document.querySelectorAll('[data-at]');
    for (var i = 0; i < els.length; i++) {
      var el = els[i];
      var at = Number(el.getAttribute('data-at'));
      var d = Math.round(now - at);
      if (el.getAttribute('data-mode') === 'for') {
        el.textContent = dur(Math.max(0, d));
      } else {
        el.textContent = d >= 0 ? dur(d) + ' ago' : 'in ' + dur(-d);
      }
    }
  }

  function appendEvent(table, e) {
    var body = table.querySelector('tbody');
    var empty = body.querySelector('tr.empty');
    if (empty) { empty.remove(); }
    var tr = document.createElement('tr');
    tr.className = 'live-event';
    var cells = [String(e.seq), new Date(e.at_ms).toISOString(), e.turn_id, e.kind,
      JSON.stringify(e.detail)];
    for (var i = 0; i < cells.length; i++) {
      var td = document.createElement('td');
      if (i === 4) { td.className = 'wrap'; }
      td.textContent = cells[i];
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }

  function follow() {
    var live = document.getElementById('live');
    if (!live || !window.EventSource) { return; }
    var status = document.getElementById('feed-status');
    var table = document.getElementById('feed');
    var es = new EventSource(live.getAttribute('data-feed'));
    document.body.setAttribute('data-feed', 'opening');
    es.onopen = function () {
      document.body.setAttribute('data-feed', 'live');
      if (status) { status.textContent = 'live'; }
    };
    es.onerror = function () {
      var closed = es.readyState === EventSource.CLOSED;
      document.body.setAttribute('data-feed', closed ? 'closed' : 'reconnecting');
      if (status) { status.textContent = closed ? 'not live: reload the page' : 'reconnecting'; }
    };
    es.addEventListener('refresh', function (m) {
      live.innerHTML = m.data;
      tick();
    });
    es.onmessage = function (m) {
      if (!table || table.getAttribute('data-append') !== '1') { return; }
      var e;
      try { e = JSON.parse(m.data); } catch (x) { return; }
      appendEvent(table, e);
    };
  }

  function start() {
    var now = Number(document.body.getAttribute('data-now'));
    if (now) { skew = now - Date.now(); }
    tick();
    setInterval(tick, 1000);
    follow();
  }

  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', start);
  } else {
    start();
  }
})();
