// xterm.js's DOM renderer writes its theme and cell sizes into <style>
// elements, which the console's CSP (style-src 'self', no
// 'unsafe-inline') blocks. Here, an element created as 'style' is an
// inert <template> instead (nothing in it is parsed, so no CSP check and
// no violation), and what xterm.js writes to its textContent goes into a
// constructed stylesheet adopted by the document: CSSOM, which CSP does
// not govern. The policy stays strict; xterm.js keeps its looks.
// Imported first by app.js, before xterm.js runs.

const create = Document.prototype.createElement;

Document.prototype.createElement = function createElement(tag, options) {
  if (String(tag).toLowerCase() !== 'style' || !('adoptedStyleSheets' in this)) {
    return create.call(this, tag, options);
  }
  return mirror(create.call(this, 'template'), this);
};

function mirror(el, doc) {
  const sheet = new CSSStyleSheet();
  doc.adoptedStyleSheets = [...doc.adoptedStyleSheets, sheet];
  let text = '';
  Object.defineProperty(el, 'textContent', {
    configurable: true,
    get() {
      return text;
    },
    set(v) {
      text = String(v);
      sheet.replaceSync(text);
    },
  });
  const remove = el.remove.bind(el);
  el.remove = () => {
    doc.adoptedStyleSheets = doc.adoptedStyleSheets.filter((s) => s !== sheet);
    remove();
  };
  el.dataset.bmxStyle = '';
  return el;
}
