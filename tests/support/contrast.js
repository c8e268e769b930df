// WCAG 2 contrast of every visible text element against its effective background;
// returns the elements below AA (4.5:1, or 3:1 for large text).
function channel(c) { c /= 255; return c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4); }
function luminance(rgb) { return 0.2126 * channel(rgb[0]) + 0.7152 * channel(rgb[1]) + 0.0722 * channel(rgb[2]); }
function parse(color) { const m = color.match(/[\d.]+/g).map(Number); return [m[0], m[1], m[2], m.length > 3 ? m[3] : 1]; }
function background(el) {
  for (let node = el; node; node = node.parentElement) {
    const c = parse(getComputedStyle(node).backgroundColor);
    if (c[3] > 0.5) { return c; }
  }
  return [255, 255, 255, 1];
}
const bad = [];
for (const el of document.querySelectorAll('body *')) {
  if (el.closest('svg, script, style, .js-plotly-plot, .sr-only, .skip-link')) { continue; }
  const own = Array.from(el.childNodes).some(n => n.nodeType === 3 && n.textContent.trim());
  if (!own || !el.getClientRects().length) { continue; }
  const style = getComputedStyle(el);
  if (style.visibility === 'hidden' || style.display === 'none') { continue; }
  const fg = parse(style.color), bg = background(el);
  const l1 = luminance(fg), l2 = luminance(bg);
  const ratio = (Math.max(l1, l2) + 0.05) / (Math.min(l1, l2) + 0.05);
  const large = parseFloat(style.fontSize) >= 24 || (parseFloat(style.fontSize) >= 18.66 && Number(style.fontWeight) >= 700);
  if (ratio < (large ? 3 : 4.5)) { bad.push(el.tagName + ' "' + el.textContent.trim().slice(0, 40) + '" ' + ratio.toFixed(2)); }
}
return bad;
