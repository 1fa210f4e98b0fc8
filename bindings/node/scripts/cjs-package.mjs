// The CommonJS build lives in dist/cjs; this marks that folder as CommonJS so Node
// loads its .js files with require() semantics while the package itself is ESM.
import { writeFileSync } from "node:fs";
writeFileSync(new URL("../dist/cjs/package.json", import.meta.url), '{"type": "commonjs"}\n');
