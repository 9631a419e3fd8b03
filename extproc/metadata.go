package extproc

import (
	"math"
	"strings"
	"unicode/utf8"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/llm-bulkhead/llm-bulkhead/policy"
)

// The dynamic metadata is written straight in protobuf's wire format and attached to the reply
// as its dynamic_metadata field's bytes: Envoy (and any other reader) decodes an ordinary
// google.protobuf.Struct. Building a Struct instead costs a map, a Value and a oneof wrapper per
// key, and its reflective marshalling was the largest part of the server's own marshalling
// cost per stream.

// Field numbers of the messages written here (envoy.service.ext_proc.v3.ProcessingResponse,
// google.protobuf.Struct, its map entry and google.protobuf.Value). TestMetadataWireFieldNumbers
// checks them against the generated descriptors.
const (
	fieldResponseDynamicMetadata protowire.Number = 8
	fieldStructFields            protowire.Number = 1
	fieldEntryKey                protowire.Number = 1
	fieldEntryValue              protowire.Number = 2
	fieldValueNumber             protowire.Number = 2
	fieldValueString             protowire.Number = 3
	fieldValueBool               protowire.Number = 4
	fieldValueStruct             protowire.Number = 5
)

// The append functions below add one field to a Struct's encoding. Each field is a map entry
// holding a Value; sizes are known before anything is written, so nothing is copied twice.

func appendEntry(b []byte, key string, valueField protowire.Number, valueSize int) []byte {
	value := protowire.SizeTag(valueField) + valueSize
	entry := protowire.SizeTag(fieldEntryKey) + protowire.SizeBytes(len(key)) +
		protowire.SizeTag(fieldEntryValue) + protowire.SizeBytes(value)
	b = protowire.AppendTag(b, fieldStructFields, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(entry))
	b = protowire.AppendTag(b, fieldEntryKey, protowire.BytesType)
	b = protowire.AppendString(b, key)
	b = protowire.AppendTag(b, fieldEntryValue, protowire.BytesType)
	return protowire.AppendVarint(b, uint64(value))
}

// appendString writes a string Value. Protobuf strings must be UTF-8: Envoy (and any other
// reader) refuses to parse a reply holding one that is not, and the request fails. Values
// classification yields are valid already; one a response names (response_model) may not be,
// and each run of bytes in it that are not UTF-8 becomes U+FFFD.
func appendString(b []byte, key, v string) []byte {
	if !utf8.ValidString(v) {
		v = strings.ToValidUTF8(v, "\uFFFD")
	}
	b = appendEntry(b, key, fieldValueString, protowire.SizeBytes(len(v)))
	b = protowire.AppendTag(b, fieldValueString, protowire.BytesType)
	return protowire.AppendString(b, v)
}

func appendNumber(b []byte, key string, v float64) []byte {
	b = appendEntry(b, key, fieldValueNumber, protowire.SizeFixed64())
	b = protowire.AppendTag(b, fieldValueNumber, protowire.Fixed64Type)
	return protowire.AppendFixed64(b, math.Float64bits(v))
}

func appendBool(b []byte, key string, v bool) []byte {
	b = appendEntry(b, key, fieldValueBool, protowire.SizeVarint(protowire.EncodeBool(v)))
	b = protowire.AppendTag(b, fieldValueBool, protowire.VarintType)
	return protowire.AppendVarint(b, protowire.EncodeBool(v))
}

// appendMetadataFields appends the request's metadata fields (the namespace's Struct, without
// its envelope): classification, decision and, once settled, usage.
func (p *processor) appendMetadataFields(b []byte) []byte {
	d := p.dec.decision
	s := p.snap
	b = appendString(b, "feature", s.FeatureName(d.Dims.Feature))
	b = appendString(b, "tenant", d.Dims.Tenant)
	b = appendString(b, "tier", s.TierName(d.Dims.Tier))
	b = appendString(b, "provider", s.ProviderName(d.Dims.Provider))
	b = appendString(b, "model", d.Dims.Model)
	if d.OriginalModel != "" {
		b = appendString(b, "original_model", d.OriginalModel)
	}
	b = appendNumber(b, "estimated_tokens", float64(p.dec.estimate.Total))
	switch {
	case d.Verdict != policy.Admit:
		b = appendString(b, "decision", "rejected")
		b = appendString(b, "reason", string(d.Reason))
		b = appendString(b, "compartment", d.Compartment)
	case d.Rerouted:
		b = appendString(b, "decision", "rerouted")
		b = appendString(b, "reason", string(d.Reason))
		b = appendString(b, "compartment", p.dec.compartments)
	default:
		b = appendString(b, "decision", "admitted")
		b = appendString(b, "compartment", p.dec.compartments)
	}
	if d.Verdict == policy.Admit {
		if amount, ok := p.dec.ticket.SpendReserved(); ok {
			b = appendNumber(b, "spend_reserved", amount.Float())
		}
	}
	if p.phase == phaseDone && d.Verdict == policy.Admit {
		st, u := p.res.settled, p.res.outcome.Usage
		b = appendNumber(b, "prompt_tokens", float64(st.Prompt))
		b = appendNumber(b, "completion_tokens", float64(st.Completion))
		b = appendNumber(b, "total_tokens", float64(st.Total))
		b = appendNumber(b, "cached_tokens", float64(u.Cached))
		b = appendNumber(b, "reasoning_tokens", float64(u.Reasoning))
		b = appendBool(b, "usage_reported", u.Known)
		if st.HasCost {
			b = appendNumber(b, "spend", st.Cost.Float())
		}
		if m := p.res.outcome.Model; m != "" {
			b = appendString(b, "response_model", m)
		}
		if e := p.res.outcome.StreamError; e != policy.StreamErrorNone {
			b = appendString(b, "stream_error", streamErrorNames[e])
		}
	}
	return b
}

// streamErrorNames are the metadata values of the errors a 2xx response body may report.
var streamErrorNames = [...]string{policy.StreamErrorServer: "server", policy.StreamErrorRateLimited: "rate_limited",
	policy.StreamErrorClient: "client"}

// metadataBytes returns the reply's dynamic_metadata field, tag included, in wire format:
// a Struct with the policy's namespace holding the request's fields. It returns nil when
// nothing was decided (no metadata to leave). The bytes are the stream's reply memory
// (replyMem.meta): valid until the next message is handled.
func (p *processor) metadataBytes() []byte {
	if p.snap == nil || !p.decided() {
		return nil
	}
	// The namespace's fields first, into scratch space on the stack; then the envelopes, whose
	// lengths depend on them, and the fields into one buffer of the exact size.
	var scratch [512]byte
	inner := p.appendMetadataFields(scratch[:0])
	ns := p.srv.settingsOf(p.snap).MetadataNamespace
	nsValue := protowire.SizeTag(fieldValueStruct) + protowire.SizeBytes(len(inner))
	nsEntry := protowire.SizeTag(fieldEntryKey) + protowire.SizeBytes(len(ns)) +
		protowire.SizeTag(fieldEntryValue) + protowire.SizeBytes(nsValue)
	outer := protowire.SizeTag(fieldStructFields) + protowire.SizeBytes(nsEntry)
	b := p.out.meta[:0]
	if n := protowire.SizeTag(fieldResponseDynamicMetadata) + protowire.SizeBytes(outer); cap(b) < n {
		b = make([]byte, 0, max(n, 2*cap(b)))
	}
	b = protowire.AppendTag(b, fieldResponseDynamicMetadata, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(outer))
	b = appendEntry(b, ns, fieldValueStruct, protowire.SizeBytes(len(inner)))
	b = protowire.AppendTag(b, fieldValueStruct, protowire.BytesType)
	b = protowire.AppendBytes(b, inner)
	p.out.meta = b
	return b
}

// withMetadata attaches the request's dynamic metadata to resp, which must be a reply built
// for this stream (never a shared one), and returns it.
func (p *processor) withMetadata(resp *extprocv3.ProcessingResponse) *extprocv3.ProcessingResponse {
	if b := p.metadataBytes(); b != nil {
		resp.ProtoReflect().SetUnknown(protoreflect.RawFields(b))
	}
	return resp
}
