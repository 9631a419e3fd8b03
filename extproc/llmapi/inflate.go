package llmapi

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/bits"
	"sync"
)

// inflater decodes DEFLATE (RFC 1951) inside gzip (RFC 1952) or zlib
// (RFC 1950) framing in push style: each write hands it whatever compressed
// bytes Envoy delivered and it decodes as far as they go, keeping only its bit
// buffer and the 32 KiB history window between writes. compress/gzip pulls
// from an io.Reader and cannot be resumed after running out of input, so
// using it here would take a goroutine per compressed response and a write
// that can block; this decoder needs neither.
//
// Decoded bytes are handed to the sink straight out of the history window, in
// runs of at most 32 KiB. An inflater is not safe for concurrent use; pooled
// instances are reused across responses.
type inflater struct {
	format    uint8
	state     uint8
	finishing bool
	err       error

	in   []byte
	ipos int
	bits uint64
	nb   uint // valid bits in bits; the bits above are always zero

	window  [windowSize]byte
	wpos    int
	flushed int
	total   int64 // bytes decoded in this member
	all     int64 // bytes decoded in the whole body
	limit   int64 // most bytes the whole body may decode to
	sum     uint32
	sumA    uint32 // Adler-32 halves
	sumB    uint32

	final            bool
	stored           int
	lit, dist        *huffman
	dynLit, dynDist  huffman
	codeLen          huffman
	hlit, hdist, hcl int
	idx              int
	lens             [maxLitSyms + maxDistSyms]uint8

	zlib  bool // formatZlibOrRaw turned out to be zlib: an Adler-32 trailer follows
	flags byte
	hdrN  int
	xlen  int
	trail uint64
}

const (
	windowSize  = 1 << 15
	maxLitSyms  = 288
	maxDistSyms = 32
	// maxDecoded bounds what one response may expand to, so a small
	// compressed body cannot make the scanner chew through gigabytes.
	maxDecoded = 256 << 20
)

// Framing formats.
const (
	formatGzip uint8 = iota
	formatZlibOrRaw
)

// States.
const (
	zGzipMagic uint8 = iota
	zGzipFixed
	zGzipXlen
	zGzipExtra
	zGzipName
	zGzipComment
	zGzipHCRC
	zDetect
	zBlockHeader
	zStoredLen
	zStored
	zDynHeader
	zCodeLenLens
	zLitDistLens
	zData
	zGzipTrailer
	zZlibTrailer
	zMemberEnd // after a gzip member: another may follow
	zEnd       // after a zlib or raw stream: nothing more is read
)

var inflaters = sync.Pool{New: func() any { return new(inflater) }}

func getInflater(format uint8) *inflater {
	z := inflaters.Get().(*inflater)
	z.reset(format)
	return z
}

func putInflater(z *inflater) {
	if z != nil {
		z.in = nil
		inflaters.Put(z)
	}
}

func (z *inflater) reset(format uint8) {
	z.format = format
	z.state = zGzipMagic
	if format == formatZlibOrRaw {
		z.state = zDetect
	}
	z.finishing = false
	z.err = nil
	z.in, z.ipos = nil, 0
	z.bits, z.nb = 0, 0
	z.wpos, z.flushed = 0, 0
	z.total, z.all = 0, 0
	z.limit = maxDecoded
	z.startMember()
	z.hdrN = 0
}

func (z *inflater) startMember() {
	z.total = 0
	z.sum = 0
	z.sumA, z.sumB = 1, 0
	z.final = false
}

// plainSink receives decoded bytes; it must not retain them.
type plainSink interface {
	plain(p []byte)
}

// write decodes as much of p as possible.
func (z *inflater) write(p []byte, out plainSink) error {
	if z.err != nil {
		return z.err
	}
	z.in, z.ipos = p, 0
	z.err = z.run(out)
	z.flush(out)
	z.in = nil
	return z.err
}

// finish decodes what the bit buffer still holds now that no more input will
// come, and reports a stream that ended before its end.
func (z *inflater) finish(out plainSink) error {
	if z.err != nil {
		return z.err
	}
	z.finishing = true
	z.err = z.run(out)
	z.flush(out)
	if z.err == nil {
		switch z.state {
		case zMemberEnd, zEnd:
		case zGzipMagic:
			if z.all == 0 && z.hdrN == 0 {
				break // an empty body
			}
			z.err = corrupt("unexpected end of stream")
		default:
			z.err = corrupt("unexpected end of stream")
		}
	}
	return z.err
}

func corrupt(why string) error { return fmt.Errorf("%w: %s", ErrCorruptCompression, why) }

// refill tops the bit buffer up to at least 56 bits while input lasts.
func (z *inflater) refill() {
	if z.nb <= 56 && z.ipos+8 <= len(z.in) {
		v := binary.LittleEndian.Uint64(z.in[z.ipos:])
		n := (63 - z.nb) >> 3
		z.bits |= v << z.nb
		z.ipos += int(n)
		z.nb += n * 8
		z.bits &= 1<<z.nb - 1
		return
	}
	for z.nb <= 56 && z.ipos < len(z.in) {
		z.bits |= uint64(z.in[z.ipos]) << z.nb
		z.nb += 8
		z.ipos++
	}
}

func (z *inflater) need(n uint) bool {
	if z.nb < n {
		z.refill()
	}
	return z.nb >= n
}

func (z *inflater) take(n uint) uint32 {
	v := uint32(z.bits & (1<<n - 1))
	z.bits >>= n
	z.nb -= n
	return v
}

// more reports whether the caller should stop for lack of input: nil when more
// input may come, an error when the stream is being finished.
func (z *inflater) more() error {
	if z.finishing {
		return corrupt("unexpected end of stream")
	}
	return nil
}

func (z *inflater) run(out plainSink) error {
	for {
		switch z.state {
		case zGzipMagic:
			// Two magic bytes, method, flags; an empty remainder here is a
			// clean end once one member has been read.
			if !z.need(8) {
				return nil
			}
			b := byte(z.take(8))
			switch z.hdrN {
			case 0:
				if b != 0x1f {
					return corrupt("not gzip")
				}
			case 1:
				if b != 0x8b {
					return corrupt("not gzip")
				}
			case 2:
				if b != 8 {
					return corrupt("unknown gzip method")
				}
			case 3:
				z.flags = b
				z.state, z.hdrN = zGzipFixed, 0
				continue
			}
			z.hdrN++
		case zGzipFixed:
			// MTIME, XFL and OS are of no use here.
			for z.hdrN < 6 {
				if !z.need(8) {
					return z.more()
				}
				z.take(8)
				z.hdrN++
			}
			z.state, z.hdrN, z.xlen = zGzipXlen, 0, 0
		case zGzipXlen:
			if z.flags&0x04 == 0 {
				z.state = zGzipName
				continue
			}
			for z.hdrN < 2 {
				if !z.need(8) {
					return z.more()
				}
				z.xlen |= int(z.take(8)) << (8 * z.hdrN)
				z.hdrN++
			}
			z.state = zGzipExtra
		case zGzipExtra:
			for z.xlen > 0 {
				if !z.need(8) {
					return z.more()
				}
				z.take(8)
				z.xlen--
			}
			z.state = zGzipName
		case zGzipName, zGzipComment:
			flag := byte(0x08)
			if z.state == zGzipComment {
				flag = 0x10
			}
			if z.flags&flag != 0 {
				for {
					if !z.need(8) {
						return z.more()
					}
					if z.take(8) == 0 {
						break
					}
				}
			}
			z.state++
			z.hdrN = 0
		case zGzipHCRC:
			if z.flags&0x02 != 0 {
				for z.hdrN < 2 {
					if !z.need(8) {
						return z.more()
					}
					z.take(8)
					z.hdrN++
				}
			}
			z.state = zBlockHeader
		case zDetect:
			if !z.need(16) {
				if z.finishing && z.nb == 0 && z.all == 0 {
					z.state = zEnd
					return nil
				}
				if !z.finishing {
					return nil
				}
				// Too short for a zlib header: it can only be raw deflate.
				z.zlib = false
				z.state = zBlockHeader
				continue
			}
			cmf, flg := byte(z.bits), byte(z.bits>>8)
			if cmf&0x0f == 8 && cmf>>4 <= 7 && (uint16(cmf)<<8|uint16(flg))%31 == 0 {
				if flg&0x20 != 0 {
					return corrupt("zlib preset dictionary")
				}
				z.take(16)
				z.zlib = true
			} else {
				// Some servers send raw deflate under "deflate".
				z.zlib = false
			}
			z.state = zBlockHeader
		case zBlockHeader:
			if !z.need(3) {
				return z.more()
			}
			h := z.take(3)
			z.final = h&1 == 1
			switch h >> 1 {
			case 0:
				z.take(z.nb & 7)
				z.state = zStoredLen
			case 1:
				z.lit, z.dist = &fixedLit, &fixedDist
				z.state = zData
			case 2:
				z.state = zDynHeader
			default:
				return corrupt("invalid block type")
			}
		case zStoredLen:
			if !z.need(32) {
				return z.more()
			}
			n := z.take(16)
			if nn := z.take(16); n != ^nn&0xffff {
				return corrupt("stored block length mismatch")
			}
			z.stored = int(n)
			z.state = zStored
		case zStored:
			if err := z.copyStored(out); err != nil {
				return err
			}
			if z.stored > 0 {
				return z.more()
			}
			z.endBlock()
		case zDynHeader:
			if !z.need(14) {
				return z.more()
			}
			z.hlit = int(z.take(5)) + 257
			z.hdist = int(z.take(5)) + 1
			z.hcl = int(z.take(4)) + 4
			if z.hlit > 286 || z.hdist > 30 {
				return corrupt("too many codes")
			}
			z.idx = 0
			clear(z.lens[:19])
			z.state = zCodeLenLens
		case zCodeLenLens:
			for z.idx < z.hcl {
				if !z.need(3) {
					return z.more()
				}
				z.lens[codeLenOrder[z.idx]] = uint8(z.take(3))
				z.idx++
			}
			if !z.codeLen.build(z.lens[:19]) {
				return corrupt("invalid code length code")
			}
			z.idx = 0
			z.state = zLitDistLens
		case zLitDistLens:
			if err := z.readLens(); err != nil || z.idx < z.hlit+z.hdist {
				if err != nil {
					return err
				}
				return z.more()
			}
			if z.lens[256] == 0 {
				return corrupt("no end-of-block code")
			}
			if !z.dynLit.build(z.lens[:z.hlit]) || !z.dynDist.build(z.lens[z.hlit:z.hlit+z.hdist]) {
				return corrupt("invalid Huffman code")
			}
			z.lit, z.dist = &z.dynLit, &z.dynDist
			z.state = zData
		case zData:
			done, err := z.decodeData(out)
			if err != nil {
				return err
			}
			if !done {
				return z.more()
			}
			z.endBlock()
		case zGzipTrailer, zZlibTrailer:
			n := 8
			if z.state == zZlibTrailer {
				n = 4
			}
			for z.hdrN < n {
				if !z.need(8) {
					return z.more()
				}
				z.trail |= uint64(z.take(8)) << (8 * z.hdrN)
				z.hdrN++
			}
			z.flush(out)
			if z.state == zGzipTrailer {
				if uint32(z.trail) != z.sum || uint32(z.trail>>32) != uint32(z.total) {
					return corrupt("gzip checksum mismatch")
				}
				z.state = zMemberEnd
				continue
			}
			if bits.ReverseBytes32(uint32(z.trail)) != z.sumB<<16|z.sumA {
				return corrupt("zlib checksum mismatch")
			}
			z.state = zEnd
		case zMemberEnd:
			if !z.need(8) {
				return nil
			}
			// Another member follows (concatenated gzip is valid gzip).
			z.startMember()
			z.state, z.hdrN = zGzipMagic, 0
		case zEnd:
			// Anything after the stream is ignored, as HTTP clients do.
			z.ipos = len(z.in)
			z.bits, z.nb = 0, 0
			return nil
		}
	}
}

// endBlock moves on after a block: to the next block, or to the trailer of
// the framing after the final one.
func (z *inflater) endBlock() {
	if !z.final {
		z.state = zBlockHeader
		return
	}
	z.take(z.nb & 7)
	z.trail, z.hdrN = 0, 0
	switch {
	case z.format == formatGzip:
		z.state = zGzipTrailer
	case z.zlib:
		z.state = zZlibTrailer
	default:
		z.state = zEnd
	}
}

var codeLenOrder = [19]uint8{16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15}

// readLens reads the run-length coded literal/length and distance code
// lengths of a dynamic block. Each step needs at most 14 bits (a 7-bit code
// and 7 extra bits), so it waits for that many before committing to one.
func (z *inflater) readLens() error {
	total := z.hlit + z.hdist
	for z.idx < total {
		if !z.need(14) && !z.finishing {
			return nil
		}
		sym, n := z.codeLen.decode(z.bits)
		if n == 0 || n > z.nb {
			return corrupt("bad code length")
		}
		switch {
		case sym < 16:
			z.take(n)
			z.lens[z.idx] = uint8(sym)
			z.idx++
			continue
		}
		extra, base := uint(2), 3
		switch sym {
		case 17:
			extra, base = 3, 3
		case 18:
			extra, base = 7, 11
		}
		if n+extra > z.nb {
			return corrupt("bad code length")
		}
		z.take(n)
		rep := base + int(z.take(extra))
		var v uint8
		if sym == 16 {
			if z.idx == 0 {
				return corrupt("repeat with no previous length")
			}
			v = z.lens[z.idx-1]
		}
		if z.idx+rep > total {
			return corrupt("code lengths overflow")
		}
		for ; rep > 0; rep-- {
			z.lens[z.idx] = v
			z.idx++
		}
	}
	return nil
}

// copyStored copies a stored block, first from whole bytes left in the bit
// buffer, then straight from the input.
func (z *inflater) copyStored(out plainSink) error {
	for z.stored > 0 && z.nb >= 8 {
		if err := z.put(byte(z.take(8)), out); err != nil {
			return err
		}
		z.stored--
	}
	for z.stored > 0 && z.ipos < len(z.in) {
		n := min(z.stored, len(z.in)-z.ipos, windowSize-z.wpos)
		copy(z.window[z.wpos:], z.in[z.ipos:z.ipos+n])
		z.wpos += n
		z.ipos += n
		z.stored -= n
		if err := z.advance(n, out); err != nil {
			return err
		}
	}
	return nil
}

// put appends one decoded byte.
func (z *inflater) put(b byte, out plainSink) error {
	z.window[z.wpos] = b
	z.wpos++
	return z.advance(1, out)
}

// advance accounts for n bytes just written to the window, emitting the
// window when it is full.
func (z *inflater) advance(n int, out plainSink) error {
	z.total += int64(n)
	z.all += int64(n)
	if z.all > z.limit {
		return corrupt("decoded body exceeds the size limit")
	}
	if z.wpos == windowSize {
		z.flush(out)
		z.wpos, z.flushed = 0, 0
	}
	return nil
}

// flush hands the decoded bytes not yet emitted to out and folds them into
// the checksum of the framing.
func (z *inflater) flush(out plainSink) {
	if z.wpos <= z.flushed {
		return
	}
	p := z.window[z.flushed:z.wpos]
	z.flushed = z.wpos
	if z.format == formatGzip {
		z.sum = crc32.Update(z.sum, crc32.IEEETable, p)
	} else if z.zlib {
		z.sumA, z.sumB = adler32Update(z.sumA, z.sumB, p)
	}
	out.plain(p)
}

// adler32Update folds p into the two Adler-32 halves, reducing before the
// 32-bit sums can overflow.
func adler32Update(a, b uint32, p []byte) (uint32, uint32) {
	const mod, nmax = 65521, 5552
	for len(p) > 0 {
		n := min(len(p), nmax)
		for _, c := range p[:n] {
			a += uint32(c)
			b += a
		}
		a %= mod
		b %= mod
		p = p[n:]
	}
	return a, b
}

// decodeData decodes the symbols of a Huffman block until its end-of-block
// code (done) or until the input runs short. A literal/length symbol with its
// distance takes at most 48 bits, so while more input may come a symbol is
// only started with 48 bits at hand and never has to be suspended halfway.
func (z *inflater) decodeData(out plainSink) (done bool, err error) {
	for {
		if z.nb < 48 {
			z.refill()
			if z.nb < 48 && !z.finishing {
				return false, nil
			}
		}
		sym, n := z.lit.decode(z.bits)
		if n == 0 || n > z.nb {
			if n != 0 && z.finishing {
				return false, nil
			}
			return false, corrupt("invalid literal/length code")
		}
		if sym < 256 {
			z.take(n)
			if err := z.put(byte(sym), out); err != nil {
				return false, err
			}
			continue
		}
		if sym == 256 {
			z.take(n)
			return true, nil
		}
		sym -= 257
		if sym >= 29 {
			return false, corrupt("invalid length code")
		}
		lenExtra := uint(lengthExtra[sym])
		dsym, dn := z.dist.decode(z.bits >> (n + lenExtra))
		if dn == 0 {
			return false, corrupt("invalid distance code")
		}
		if dsym >= 30 {
			return false, corrupt("invalid distance code")
		}
		distExtra := uint(distanceExtra[dsym])
		if n+lenExtra+dn+distExtra > z.nb {
			return false, nil // only when finishing: the stream was cut
		}
		z.take(n)
		length := int(lengthBase[sym]) + int(z.take(lenExtra))
		z.take(dn)
		dist := int(distanceBase[dsym]) + int(z.take(distExtra))
		if int64(dist) > z.total || dist > windowSize {
			return false, corrupt("distance too far back")
		}
		if err := z.copyMatch(length, dist, out); err != nil {
			return false, err
		}
	}
}

// copyMatch appends length bytes copied from dist bytes back.
func (z *inflater) copyMatch(length, dist int, out plainSink) error {
	src := z.wpos - dist
	if src < 0 {
		src += windowSize
	}
	for length > 0 {
		n := min(length, windowSize-z.wpos, windowSize-src)
		if dist >= n {
			copy(z.window[z.wpos:z.wpos+n], z.window[src:src+n])
		} else {
			for k := range n {
				z.window[z.wpos+k] = z.window[src+k]
			}
		}
		z.wpos += n
		src += n
		if src == windowSize {
			src = 0
		}
		length -= n
		if err := z.advance(n, out); err != nil {
			return err
		}
	}
	return nil
}

var (
	lengthBase    = [29]uint16{3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258}
	lengthExtra   = [29]uint8{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0}
	distanceBase  = [30]uint16{1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577}
	distanceExtra = [30]uint8{0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13}
)

// huffman is a canonical Huffman decoding table: a 9-bit first level and
// second-level tables for longer codes. An entry holds the symbol in its high
// 16 bits and the code length in its low 4; a first-level entry with
// huffLink set points instead at a second-level table whose index width is in
// its low 4 bits. A zero entry marks a bit pattern no code uses.
type huffman struct {
	primary [1 << huffPrimary]uint32
	sub     []uint32
}

const (
	huffPrimary = 9
	huffLink    = 1 << 4
	huffValid   = 1 << 5
	maxCodeLen  = 15
)

// build fills the table from code lengths. It rejects over-subscribed codes;
// incomplete ones are allowed (a single distance code is legal) and decode
// their unused patterns as invalid.
func (h *huffman) build(lens []uint8) bool {
	var count [maxCodeLen + 1]int
	for _, l := range lens {
		count[l]++
	}
	count[0] = 0
	left := 1
	for l := 1; l <= maxCodeLen; l++ {
		left = left<<1 - count[l]
		if left < 0 {
			return false
		}
	}
	var next [maxCodeLen + 2]int
	code := 0
	for l := 1; l <= maxCodeLen; l++ {
		code = (code + count[l-1]) << 1
		next[l] = code
	}
	clear(h.primary[:])
	h.sub = h.sub[:0]
	// Size each second-level table for the longest code sharing its prefix.
	var width [1 << huffPrimary]uint8
	codes := next
	for _, l := range lens {
		if l == 0 {
			continue
		}
		rev := reverseBits(codes[l], uint(l))
		codes[l]++
		if l > huffPrimary {
			p := rev & (1<<huffPrimary - 1)
			width[p] = max(width[p], l-huffPrimary)
		}
	}
	for p, w := range width {
		if w == 0 {
			continue
		}
		h.primary[p] = uint32(len(h.sub))<<16 | huffLink | uint32(w)
		h.sub = append(h.sub, make([]uint32, 1<<w)...)
	}
	codes = next
	for sym, l := range lens {
		if l == 0 {
			continue
		}
		rev := reverseBits(codes[l], uint(l))
		codes[l]++
		e := uint32(sym)<<16 | huffValid | uint32(l)
		if l <= huffPrimary {
			for j := rev; j < 1<<huffPrimary; j += 1 << l {
				h.primary[j] = e
			}
			continue
		}
		link := h.primary[rev&(1<<huffPrimary-1)]
		off, w := int(link>>16), uint(link&15)
		for j := rev >> huffPrimary; j < 1<<w; j += 1 << (uint(l) - huffPrimary) {
			h.sub[off+j] = e
		}
	}
	return true
}

// decode returns the symbol at the bottom of bits and its code length; n is 0
// when the bits match no code.
func (h *huffman) decode(b uint64) (sym int, n uint) {
	e := h.primary[b&(1<<huffPrimary-1)]
	if e&huffLink != 0 {
		e = h.sub[int(e>>16)+int(b>>huffPrimary)&(1<<(e&15)-1)]
	}
	if e&huffValid == 0 {
		return 0, 0
	}
	return int(e >> 16), uint(e & 15)
}

func reverseBits(code int, n uint) int {
	return int(bits.Reverse16(uint16(code)) >> (16 - n))
}

// The fixed Huffman codes of RFC 1951 section 3.2.6.
var fixedLit, fixedDist = func() (lit, dist huffman) {
	var l [maxLitSyms]uint8
	for i := range l {
		switch {
		case i < 144:
			l[i] = 8
		case i < 256:
			l[i] = 9
		case i < 280:
			l[i] = 7
		default:
			l[i] = 8
		}
	}
	lit.build(l[:])
	var d [maxDistSyms]uint8
	for i := range d {
		d[i] = 5
	}
	dist.build(d[:])
	return lit, dist
}()
