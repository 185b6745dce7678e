// Markdown to safe DOM: marked turns text into HTML, DOMPurify removes anything executable, and code
// blocks get a copy button. Model text never reaches innerHTML any other way.
"use strict";

window.renderMarkdown = (function () {
  marked.setOptions({ gfm: true, breaks: true });
  // HTML in model text is shown as written, not parsed: "vector<int>", "x<y and y>z" or "the <div> tag"
  // would otherwise become unknown elements that the sanitizer drops, words and all.
  const escapeHtml = (text) =>
    text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
  // A block of HTML keeps its lines.
  // An image is not loaded (the page fetches nothing from elsewhere, and works offline): its alt text is
  // shown instead, a link to it.
  marked.use({
    renderer: {
      html: ({ text, block }) =>
        block ? '<p class="raw-html">' + escapeHtml(text.replace(/\n+$/, "")) + "</p>" : escapeHtml(text),
      image: ({ href, text }) =>
        '<a class="image" href="' + escapeHtml(href || "") + '">' + escapeHtml(text || href || "image") + "</a>",
    },
  });
  // Links open in a new tab and cannot reach back into this page.
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
  const PURIFY = { USE_PROFILES: { html: true }, FORBID_TAGS: ["style", "form", "input", "img"] };

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    const area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
    return Promise.resolve();
  }

  function addCopyButtons(root) {
    for (const pre of root.querySelectorAll("pre")) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "copy";
      button.textContent = "Copy";
      button.addEventListener("click", () => {
        const code = pre.querySelector("code");
        copyText((code || pre).textContent).then(() => {
          button.textContent = "Copied";
          setTimeout(() => (button.textContent = "Copy"), 1200);
        });
      });
      pre.prepend(button);
    }
  }

  // Fills `element` with the rendered markdown of `text`.
  return function renderMarkdown(element, text) {
    element.innerHTML = DOMPurify.sanitize(marked.parse(text), PURIFY);
    addCopyButtons(element);
  };
})();
