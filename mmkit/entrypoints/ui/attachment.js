// The image waiting to go with the next question: chosen with the file input, dropped
// anywhere on the page or pasted, shown as a preview in the composer. No DOM outside `ui`.
//
// Any file is kept as it is (a data: URI): the server says what is wrong with it (not an
// image, too large) and the page shows that message; the preview only says when it cannot
// show the file.

function formatBytes(n) {
  if (n < 1024) return n + " B";
  if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KB";
  return (n / 1024 / 1024).toFixed(1) + " MB";
}

// ui: {input, box, preview, name, remove, overlay} elements; onChange() after every change;
// onError(message) when a file cannot be read. Returns {current(), clear(), restore(item)}
// where an item is {url, name, type, size}.
export function setupAttachment(ui, onChange, onError) {
  let current = null;

  function show(item) {
    current = item;
    ui.preview.hidden = false;
    ui.preview.src = item.url;
    ui.name.textContent = item.name + " (" + formatBytes(item.size) + ")";
    ui.box.hidden = false;
    onChange();
  }

  function clear() {
    current = null;
    ui.box.hidden = true;
    ui.preview.removeAttribute("src");
    ui.name.textContent = "";
    ui.input.value = "";
  }

  function read(file) {
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => show({ url: reader.result, name: file.name || "pasted image", type: file.type, size: file.size });
    reader.onerror = () => onError("Could not read " + (file.name || "the file") + ": " + reader.error);
    reader.readAsDataURL(file);
  }

  ui.preview.addEventListener("error", () => {
    if (!current) return;
    ui.preview.hidden = true;
    ui.name.textContent = current.name + " (no preview: this may not be an image)";
  });
  ui.input.addEventListener("change", () => read(ui.input.files[0]));
  ui.remove.addEventListener("click", () => { clear(); onChange(); });

  // Drop anywhere on the page; the overlay shows while files are dragged over it.
  let dragDepth = 0;
  const hasFiles = (event) => event.dataTransfer && Array.from(event.dataTransfer.types || []).includes("Files");
  document.addEventListener("dragenter", (event) => {
    if (!hasFiles(event)) return;
    event.preventDefault();
    dragDepth += 1;
    ui.overlay.hidden = false;
  });
  document.addEventListener("dragover", (event) => { if (hasFiles(event)) event.preventDefault(); });
  document.addEventListener("dragleave", () => {
    dragDepth = Math.max(0, dragDepth - 1);
    if (dragDepth === 0) ui.overlay.hidden = true;
  });
  document.addEventListener("drop", (event) => {
    if (!hasFiles(event)) return;
    event.preventDefault();
    dragDepth = 0;
    ui.overlay.hidden = true;
    read(event.dataTransfer.files[0]);
  });
  document.addEventListener("paste", (event) => {
    const files = event.clipboardData ? Array.from(event.clipboardData.files || []) : [];
    if (!files.length) return;  // plain text pastes into the question box as usual
    event.preventDefault();
    read(files[0]);
  });

  return { current: () => current, clear: clear, restore: show };
}
