//! noVNC's ES modules (`console/dist/vendor/novnc/`, copied from the
//! `@novnc/novnc` package by `scripts/console-assets.sh`), served under
//! `vendor/novnc/` in the package's own layout: `core/rfb.js` imports
//! `./util/…`, `./decoders/…` and `../vendor/pako/lib/zlib/…` by relative
//! path, and those paths resolve against the one hashed prefix.
//!
//! One line per file, because `include_bytes!` needs literal paths (no
//! `build.rs`, no directory-embedding crate for one list). The unit test
//! `every_vendored_novnc_module_is_embedded` fails when the script copies
//! a file this list lacks (a new noVNC release), and the other way round.

use super::Source;

/// A file under `console/dist/vendor/novnc/`, served at `vendor/novnc/…`.
macro_rules! novnc {
    ($file:literal) => {
        Source {
            path: concat!("vendor/novnc/", $file),
            file: concat!("dist/vendor/novnc/", $file),
            bytes: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/console/dist/vendor/novnc/",
                $file
            )),
        }
    };
}

pub(super) const SOURCES: &[Source] = &[
    novnc!("core/base64.js"),
    novnc!("core/crypto/aes.js"),
    novnc!("core/crypto/bigint.js"),
    novnc!("core/crypto/crypto.js"),
    novnc!("core/crypto/des.js"),
    novnc!("core/crypto/dh.js"),
    novnc!("core/crypto/md5.js"),
    novnc!("core/crypto/rsa.js"),
    novnc!("core/decoders/copyrect.js"),
    novnc!("core/decoders/h264.js"),
    novnc!("core/decoders/hextile.js"),
    novnc!("core/decoders/jpeg.js"),
    novnc!("core/decoders/raw.js"),
    novnc!("core/decoders/rre.js"),
    novnc!("core/decoders/tight.js"),
    novnc!("core/decoders/tightpng.js"),
    novnc!("core/decoders/zlib.js"),
    novnc!("core/decoders/zrle.js"),
    novnc!("core/deflator.js"),
    novnc!("core/display.js"),
    novnc!("core/encodings.js"),
    novnc!("core/inflator.js"),
    novnc!("core/input/domkeytable.js"),
    novnc!("core/input/fixedkeys.js"),
    novnc!("core/input/gesturehandler.js"),
    novnc!("core/input/keyboard.js"),
    novnc!("core/input/keysym.js"),
    novnc!("core/input/keysymdef.js"),
    novnc!("core/input/util.js"),
    novnc!("core/input/vkeys.js"),
    novnc!("core/input/xtscancodes.js"),
    novnc!("core/ra2.js"),
    novnc!("core/rfb.js"),
    novnc!("core/util/browser.js"),
    novnc!("core/util/cursor.js"),
    novnc!("core/util/element.js"),
    novnc!("core/util/events.js"),
    novnc!("core/util/eventtarget.js"),
    novnc!("core/util/int.js"),
    novnc!("core/util/logging.js"),
    novnc!("core/util/strings.js"),
    novnc!("core/websock.js"),
    novnc!("vendor/pako/lib/utils/common.js"),
    novnc!("vendor/pako/lib/zlib/adler32.js"),
    novnc!("vendor/pako/lib/zlib/constants.js"),
    novnc!("vendor/pako/lib/zlib/crc32.js"),
    novnc!("vendor/pako/lib/zlib/deflate.js"),
    novnc!("vendor/pako/lib/zlib/gzheader.js"),
    novnc!("vendor/pako/lib/zlib/inffast.js"),
    novnc!("vendor/pako/lib/zlib/inflate.js"),
    novnc!("vendor/pako/lib/zlib/inftrees.js"),
    novnc!("vendor/pako/lib/zlib/messages.js"),
    novnc!("vendor/pako/lib/zlib/trees.js"),
    novnc!("vendor/pako/lib/zlib/zstream.js"),
];
