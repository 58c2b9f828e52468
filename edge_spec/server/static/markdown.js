// A small Markdown renderer for model answers: fenced code blocks, inline code, bold and italic, headers,
// lists (nested by indentation, code blocks inside items), block quotes, rules and links.
//
// Safe by construction: it builds DOM nodes and sets only textContent, never innerHTML, so text from the
// model can never become markup; links are kept only for http(s) and mailto URLs and open with
// rel="noopener noreferrer".
//
// Every piece of text keeps its place in the source string, so the characters can be painted by where
// they came from: renderMarkdown(text, tokens) wraps each token's characters in <span class="tok src-X">,
// tokens being [{start, end, source}] sorted ranges of `text` (null: plain text, nothing wrapped).
// Code blocks are highlighted (highlight.js) the same way: the characters of each highlighted range go
// in a <span class="hl-KIND">, and the token spans inside it, so that the highlighting colours the text
// and the source its background.

import { highlight } from "./highlight.js";

const LIST_ITEM = /^([ \t]*)([-*+]|\d{1,9}[.)])[ \t]+/;
const FENCE = /^([ \t]*)(`{3,}|~{3,})[ \t]*([^\s`]*)/;
const HEADING = /^[ \t]{0,3}(#{1,6})[ \t]+/;
const RULE = /^[ \t]{0,3}([-*_])([ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^[ \t]{0,3}>[ \t]?/;
const ESCAPABLE = /[\\`*_{}[\]()#+\-.!>~|]/;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function indentOf(line) {
  let width = 0;
  for (const c of line) {
    if (c === " ") width += 1;
    else if (c === "\t") width += 4;
    else break;
  }
  return width;
}

export function sourceClass(source) {
  return "src-" + String(source).toLowerCase().replace(/[^a-z0-9]/g, "");
}

class Renderer {
  constructor(text, tokens) {
    this.text = text;
    this.tokens = tokens && tokens.length ? tokens : null;
    this.lines = [];
    let start = 0;
    for (;;) {
      const end = text.indexOf("\n", start);
      if (end < 0) {
        this.lines.push({ s: start, e: text.length });
        break;
      }
      this.lines.push({ s: start, e: end });
      start = end + 1;
    }
  }

  line(i) {
    return this.text.slice(this.lines[i].s, this.lines[i].e);
  }

  blank(i) {
    return /^\s*$/.test(this.line(i));
  }

  // -- text, painted by source ---------------------------------------------------------------------

  paint(parent, s, e) {
    if (s >= e) return;
    const tokens = this.tokens;
    if (!tokens) {
      parent.append(this.text.slice(s, e));
      return;
    }
    let lo = 0;
    let hi = tokens.length;
    while (lo < hi) {  // the first token ending after s
      const mid = (lo + hi) >> 1;
      if (tokens[mid].end <= s) lo = mid + 1;
      else hi = mid;
    }
    let pos = s;
    for (let i = lo; pos < e; i++) {
      const token = tokens[i];
      if (!token || token.start >= e) {
        parent.append(this.text.slice(pos, e));
        return;
      }
      if (token.start > pos) {
        parent.append(this.text.slice(pos, token.start));
        pos = token.start;
      }
      const end = Math.min(e, token.end);
      if (end <= pos) continue;
      const span = el("span", "tok " + sourceClass(token.source));
      span.textContent = this.text.slice(pos, end);
      span.dataset.src = token.source;
      parent.append(span);
      pos = end;
    }
  }

  // text painted within highlighted ranges: marks [{start, end, kind}], sorted ranges of the text
  marked(parent, s, e, marks) {
    let lo = 0;
    let hi = marks.length;
    while (lo < hi) {  // the first mark ending after s
      const mid = (lo + hi) >> 1;
      if (marks[mid].end <= s) lo = mid + 1;
      else hi = mid;
    }
    let pos = s;
    for (let i = lo; i < marks.length && marks[i].start < e; i++) {
      const start = Math.max(marks[i].start, pos);
      const end = Math.min(marks[i].end, e);
      if (end <= start) continue;
      this.paint(parent, pos, start);
      const span = el("span", "hl-" + marks[i].kind);
      this.paint(span, start, end);
      parent.append(span);
      pos = end;
    }
    this.paint(parent, pos, e);
  }

  // -- blocks ----------------------------------------------------------------------------------------

  blocks(parent, from, to) {
    let i = from;
    while (i < to) {
      if (this.blank(i)) {
        i += 1;
        continue;
      }
      const line = this.line(i);
      if (FENCE.test(line)) i = this.fence(parent, i, to);
      else if (HEADING.test(line)) i = this.heading(parent, i);
      else if (RULE.test(line)) {
        parent.append(el("hr"));
        i += 1;
      } else if (LIST_ITEM.test(line)) i = this.list(parent, i, to, indentOf(line));
      else if (QUOTE.test(line)) i = this.quote(parent, i, to);
      else i = this.paragraph(parent, i, to);
    }
  }

  startsBlock(i) {
    const line = this.line(i);
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || LIST_ITEM.test(line) || QUOTE.test(line);
  }

  fence(parent, i, to) {
    const open = FENCE.exec(this.line(i));
    const indent = open[1].length;
    const marker = open[2];
    const close = new RegExp("^[ \\t]*" + (marker[0] === "`" ? "`" : "~") + "{" + marker.length + ",}[ \\t]*$");
    let j = i + 1;
    while (j < to && !close.test(this.line(j))) j += 1;
    const block = el("div", "code-block");
    const head = el("div", "code-head");
    const language = el("span", "code-lang");
    language.textContent = open[3] || "code";
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "copy";
    head.append(language, copy);
    const pre = el("pre");
    const code = el("code");
    let last = j;
    if (j >= to) while (last > i + 1 && this.blank(last - 1)) last -= 1;  // unclosed (streaming): no blank tail
    const pieces = [];  // each line without the fence's own indentation: [start, end] in the text
    let source = "";  // the code as highlighted: those lines joined
    for (let k = i + 1; k < last; k++) {
      const { s, e } = this.lines[k];
      let strip = 0;
      while (strip < indent && s + strip < e && this.text[s + strip] === " ") strip += 1;
      pieces.push([s + strip, e, source.length]);
      source += this.text.slice(s + strip, e) + (k + 1 < last ? "\n" : "");
    }
    const marks = inText(highlight(source, open[3]), pieces);
    pieces.forEach(([s, e], n) => {
      this.marked(code, s, e, marks);
      if (n + 1 < pieces.length) code.append("\n");
    });
    pre.append(code);
    block.append(head, pre);
    parent.append(block);
    return j < to ? j + 1 : j;  // past the closing fence (a stream may not have sent it yet)
  }

  heading(parent, i) {
    const { s, e } = this.lines[i];
    const found = HEADING.exec(this.line(i));
    const node = el("h" + found[1].length);
    let end = e;
    const closing = /[ \t]+#+[ \t]*$/.exec(this.line(i));
    if (closing) end = s + closing.index;
    this.inline(node, s + found[0].length, end);
    parent.append(node);
    return i + 1;
  }

  quote(parent, i, to) {
    const node = el("blockquote");
    let first = true;
    while (i < to && QUOTE.test(this.line(i))) {
      const { s, e } = this.lines[i];
      if (!first) node.append(el("br"));
      this.inline(node, s + QUOTE.exec(this.line(i))[0].length, e);
      first = false;
      i += 1;
    }
    parent.append(node);
    return i;
  }

  paragraph(parent, i, to) {
    const node = el("p");
    let first = true;
    while (i < to && !this.blank(i) && (first || !this.startsBlock(i))) {
      const { s, e } = this.lines[i];
      if (!first) node.append(el("br"));
      this.inline(node, s, e);
      first = false;
      i += 1;
    }
    parent.append(node);
    return i;
  }

  list(parent, i, to, base) {
    const first = LIST_ITEM.exec(this.line(i));
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    let item = null;
    while (i < to) {
      const line = this.line(i);
      const found = LIST_ITEM.exec(line);
      const indent = indentOf(line);
      if (this.blank(i)) {  // a blank line ends the list unless an item or an indented line follows
        let next = i + 1;
        while (next < to && this.blank(next)) next += 1;
        if (next < to && (indentOf(this.line(next)) > base ||
            (LIST_ITEM.test(this.line(next)) && indentOf(this.line(next)) === base))) {
          i = next;
          continue;
        }
        break;
      }
      if (found && indent === base && /\d/.test(found[2]) === ordered) {
        item = el("li");
        this.inline(item, this.lines[i].s + found[0].length, this.lines[i].e);
        node.append(item);
        i += 1;
      } else if (item && indent > base) {  // inside the item: a nested list, a code block, more text
        if (found) i = this.list(item, i, to, indent);
        else if (FENCE.test(line)) i = this.fence(item, i, to);
        else {
          item.append(el("br"));
          this.inline(item, this.lines[i].s + (line.length - line.trimStart().length), this.lines[i].e);
          i += 1;
        }
      } else if (item && !found && !this.startsBlock(i)) {  // a lazy continuation of the item's text
        item.append(el("br"));
        this.inline(item, this.lines[i].s, this.lines[i].e);
        i += 1;
      } else break;
    }
    parent.append(node);
    return i;
  }

  // -- inline ----------------------------------------------------------------------------------------

  inline(parent, s, e) {
    const text = this.text;
    let plain = s;  // start of the text not yet painted
    let pos = s;
    const flush = (end) => {
      this.paint(parent, plain, end);
    };
    while (pos < e) {
      const c = text[pos];
      if (c === "\\" && pos + 1 < e && ESCAPABLE.test(text[pos + 1])) {
        flush(pos);
        plain = pos + 1;
        pos += 2;
        continue;
      }
      if (c === "`") {
        let run = 1;
        while (pos + run < e && text[pos + run] === "`") run += 1;
        const fence = "`".repeat(run);
        let close = text.indexOf(fence, pos + run);
        while (close >= 0 && close + run < e && text[close + run] === "`") close = text.indexOf(fence, close + run + 1);
        if (close >= 0 && close + run <= e) {
          flush(pos);
          const code = el("code");
          this.paint(code, pos + run, close);
          parent.append(code);
          pos = close + run;
          plain = pos;
          continue;
        }
        pos += run;
        continue;
      }
      if ((c === "*" || c === "_") && this.emphasis(parent, pos, e, flush)) {
        pos = this.after;
        plain = pos;
        continue;
      }
      if (c === "[" && this.link(parent, pos, e, flush)) {
        pos = this.after;
        plain = pos;
        continue;
      }
      pos += 1;
    }
    flush(e);
  }

  emphasis(parent, pos, e, flush) {
    const text = this.text;
    const c = text[pos];
    const strong = text[pos + 1] === c;
    const width = strong ? 2 : 1;
    const marker = c.repeat(width);
    const inner = pos + width;
    if (inner >= e || /\s/.test(text[inner])) return false;
    if (c === "_" && pos > 0 && /[\p{L}\p{N}]/u.test(text[pos - 1])) return false;  // snake_case
    let close = text.indexOf(marker, inner + 1);
    while (close >= 0 && close + width <= e) {
      const ok = !/\s/.test(text[close - 1]) && (strong || text[close + 1] !== c) &&
        !(c === "_" && close + width < text.length && /[\p{L}\p{N}]/u.test(text[close + width]));
      if (ok) break;
      close = text.indexOf(marker, close + 1);
    }
    if (close < 0 || close + width > e || close <= inner) return false;
    flush(pos);
    const node = el(strong ? "strong" : "em");
    this.inline(node, inner, close);
    parent.append(node);
    this.after = close + width;
    return true;
  }

  link(parent, pos, e, flush) {
    const text = this.text;
    const label = text.indexOf("](", pos + 1);
    if (label < 0 || label >= e) return false;
    const close = text.indexOf(")", label + 2);
    if (close < 0 || close >= e) return false;
    const url = text.slice(label + 2, close).trim();
    if (!SAFE_URL.test(url) || /\s/.test(url)) return false;
    flush(pos);
    const node = el("a");
    node.href = url;
    node.rel = "noopener noreferrer";
    node.target = "_blank";
    this.inline(node, pos + 1, label);
    parent.append(node);
    this.after = close + 1;
    return true;
  }
}

// Ranges of the highlighted code (offsets into the lines joined) as ranges of the text: pieces are the
// lines, [start, end, offset in the code], in order; a range over several lines becomes one per line.
function inText(ranges, pieces) {
  const out = [];
  let p = 0;
  for (const { start, end, kind } of ranges) {
    while (p < pieces.length && pieces[p][2] + (pieces[p][1] - pieces[p][0]) <= start) p += 1;
    for (let q = p; q < pieces.length && pieces[q][2] < end; q++) {
      const [s, e, offset] = pieces[q];
      const from = Math.max(start, offset) - offset;
      const to = Math.min(end, offset + (e - s)) - offset;
      if (to > from) out.push({ start: s + from, end: s + to, kind });
    }
  }
  return out;
}

export function renderMarkdown(text, tokens = null) {
  const fragment = document.createDocumentFragment();
  const renderer = new Renderer(text, tokens);
  renderer.blocks(fragment, 0, renderer.lines.length);
  return fragment;
}
