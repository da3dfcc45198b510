// Material for MkDocs calls mermaid.initialize() with its own settings; mermaid then scales
// each diagram down to the page width (useMaxWidth), so a sequence diagram with many
// participants shrinks to unreadable text. Keep every diagram at its natural size; the
// stylesheet wide-diagrams.css lets a wider one scroll sideways.
(function () {
  if (typeof mermaid === "undefined" || mermaid.__celeryIdemWide) {
    return;
  }
  var initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = function (config) {
    var wide = Object.assign({}, config || {});
    ["sequence", "flowchart", "state", "class", "er", "gantt"].forEach(function (kind) {
      wide[kind] = Object.assign({}, wide[kind] || {}, { useMaxWidth: false });
    });
    return initialize(wide);
  };
  mermaid.__celeryIdemWide = true;
})();
