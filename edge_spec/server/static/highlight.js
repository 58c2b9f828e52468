// Syntax highlighting for the code blocks of model answers, offline and without markup: highlight(code,
// language) returns ranges [{start, end, kind}] of `code` (sorted, not overlapping); the Markdown renderer
// wraps each range's characters in <span class="hl-KIND"> whose text it sets, as it does for everything
// else the model wrote.  The kinds colour the text (style.css), so a token's source, its background,
// stays visible inside a highlighted word.
//
// A lexer of a few regular expressions per family of languages, not a parser: keywords, strings,
// comments, numbers, literals, builtins, function names, decorators, shell variables and JSON keys.  It runs on every rendering of a streamed
// answer, so an unfinished string or comment runs to the end of the text and is closed by a later chunk.
// An unknown language is left plain.

const DQ = String.raw`"(?:\\.|[^"\\\n])*"?`;
const SQ = String.raw`'(?:\\.|[^'\\\n])*'?`;
const BACKTICK = String.raw`\`(?:\\[\s\S]|[^\`\\])*\`?`;
const NUMBER = String.raw`\b(?:0[xXbBoO][0-9a-fA-F_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)[a-zA-Z]*\b`;
const IDENT = String.raw`[A-Za-z_$][\w$]*`;
const END = String.raw`(?![\s\S])`;  // the end of the text (the patterns run in multiline mode: $ is a line's end)

const words = (text) => new Set(text.split(/\s+/).filter(Boolean));

const C_KEYWORDS =
  "auto break case catch class const continue default delete do else enum explicit export extern final " +
  "for friend goto if implements import inline interface namespace new operator override package private " +
  "protected public register return sizeof static struct super switch template this throw throws try " +
  "typedef typename union using virtual void volatile while";
const C_TYPES =
  "bool boolean byte char double float int long short signed unsigned size_t string String var let " +
  "int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t";

const FAMILIES = {
  python: {
    keywords: words(
      "and as assert async await break class continue def del elif else except finally for from global if " +
        "import in is lambda match case nonlocal not or pass raise return try while with yield",
    ),
    literals: words("True False None self cls"),
    builtins: words(
      "abs all any bool bytes dict enumerate filter float int isinstance len list map max min object open " +
        "print range repr reversed round set sorted str sum super tuple type zip",
    ),
    comment: "#[^\\n]*",
    strings: String.raw`[rRbBuUfF]{0,2}(?:"""[\s\S]*?(?:"""|${END})|'''[\s\S]*?(?:'''|${END})|${DQ}|${SQ})`,
    decorator: true,
    definers: words("def class"),
  },
  javascript: {
    keywords: words(
      "as async await break case catch class const continue debugger default delete do else export extends " +
        "finally for from function if import in instanceof interface let new of return static switch throw " +
        "try type typeof var void while with yield enum implements private public readonly",
    ),
    literals: words("true false null undefined this NaN Infinity"),
    builtins: words("console Math JSON Object Array String Number Promise Map Set Symbol Error document window"),
    comment: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|${END})`,
    strings: `${BACKTICK}|${DQ}|${SQ}`,
    decorator: true,
    definers: words("function class interface type"),
  },
  c: {
    keywords: words(C_KEYWORDS + " fn func go chan defer select map range struct impl trait mod pub use " +
      "crate match mut ref loop where dyn unsafe async await let var val fun when object data is in as"),
    literals: words("true false null nullptr NULL nil None Some Ok Err self Self this"),
    builtins: words(C_TYPES + " i8 i16 i32 i64 u8 u16 u32 u64 f32 f64 usize isize str Vec Option Result " +
      "printf println fmt std"),
    comment: String.raw`\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|${END})|^[ \t]*#[a-z]+[^\n]*`,
    strings: `${DQ}|${SQ}|${BACKTICK}`,
    decorator: true,
    definers: words("fn func fun class struct enum trait impl interface"),
  },
  shell: {
    keywords: words("if then else elif fi for in do done while until case esac function return export local " +
      "set unset source alias exit"),
    literals: words("true false"),
    builtins: words("echo cd ls cat grep sed awk printf read test mkdir rm cp mv pip python python3 git sudo " +
      "apt-get curl wget chmod export"),
    comment: String.raw`(?:^|(?<=\s))#[^\n]*`,
    strings: String.raw`${DQ}|'[^']*'?`,
    variable: String.raw`\$\{[^}\n]*\}?|\$[A-Za-z_]\w*|\$[0-9@#?*!$-]`,
    decorator: false,
    definers: words("function"),
  },
  json: {
    keywords: words(""),
    literals: words("true false null"),
    builtins: words(""),
    comment: null,
    strings: DQ,
    decorator: false,
    definers: words(""),
  },
  sql: {
    keywords: words(
      "select from where and or not insert into values update set delete create table drop alter add index " +
        "join left right inner outer on group by order having limit offset as distinct union all primary key " +
        "foreign references null is in like between case when then else end begin commit default unique",
    ),
    literals: words("true false null"),
    builtins: words("count sum avg min max coalesce integer int text varchar real boolean date timestamp"),
    comment: String.raw`--[^\n]*|\/\*[\s\S]*?(?:\*\/|${END})`,
    strings: `${SQ}|${DQ}`,
    decorator: false,
    definers: words(""),
    caseless: true,
  },
};

const ALIASES = {
  python: "python", py: "python", python3: "python", py3: "python", pycon: "python", ipython: "python",
  javascript: "javascript", js: "javascript", jsx: "javascript", mjs: "javascript", cjs: "javascript",
  typescript: "javascript", ts: "javascript", tsx: "javascript", node: "javascript",
  c: "c", h: "c", cpp: "c", "c++": "c", cc: "c", cxx: "c", hpp: "c", java: "c", cs: "c", csharp: "c",
  "c#": "c", go: "c", golang: "c", rust: "c", rs: "c", kotlin: "c", kt: "c", swift: "c", scala: "c",
  dart: "c", php: "c",
  sh: "shell", bash: "shell", shell: "shell", zsh: "shell", console: "shell", shellsession: "shell",
  json: "json", jsonc: "javascript", json5: "javascript",
  sql: "sql", sqlite: "sql", postgresql: "sql", mysql: "sql",
};

const compiled = new Map();

function lexer(name) {
  if (compiled.has(name)) return compiled.get(name);
  const f = FAMILIES[name];
  const parts = [
    f.comment ? `(?<com>${f.comment})` : null,
    `(?<str>${f.strings})`,
    f.variable ? `(?<var>${f.variable})` : null,
    f.decorator ? String.raw`(?<deco>@[A-Za-z_][\w.]*)` : null,
    `(?<num>${NUMBER})`,
    `(?<id>${IDENT})`,
  ].filter(Boolean);
  const found = { family: f, pattern: new RegExp(parts.join("|"), "gm" + (f.caseless ? "i" : "")) };
  compiled.set(name, found);
  return found;
}

export function languageOf(label) {
  return ALIASES[String(label || "").trim().toLowerCase()] || null;
}

export function highlight(code, label) {
  const name = languageOf(label);
  if (!name) return [];
  const { family, pattern } = lexer(name);
  const ranges = [];
  let defining = false;  // the word after def, class, function, ... names what is defined
  pattern.lastIndex = 0;
  for (let m = pattern.exec(code); m !== null; m = pattern.exec(code)) {
    if (m[0] === "") {  // a pattern that matched nothing: step on
      pattern.lastIndex += 1;
      continue;
    }
    const start = m.index;
    const end = start + m[0].length;
    const g = m.groups;
    let kind = null;
    if (g.com !== undefined) kind = "com";
    else if (g.str !== undefined) kind = name === "json" && /^\s*:/.test(code.slice(end)) ? "key" : "str";
    else if (g.var !== undefined) kind = "var";
    else if (g.deco !== undefined) kind = "deco";
    else if (g.num !== undefined) kind = "num";
    else {
      const word = family.caseless ? m[0].toLowerCase() : m[0];
      if (defining) kind = "fn";
      else if (family.keywords.has(word)) kind = "kw";
      else if (family.literals.has(word)) kind = "lit";
      else if (family.builtins.has(word)) kind = "bi";
      else if (/^\s*\(/.test(code.slice(end, end + 40))) kind = "fn";
      defining = family.definers.has(word);
      if (kind) ranges.push({ start, end, kind });
      continue;
    }
    defining = false;
    ranges.push({ start, end, kind });
  }
  return ranges;
}
